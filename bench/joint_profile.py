"""Where one joint evaluation's time goes (issue 40): the quantized model's
prefill on calibration sequences, as `mixbits refine` / `convert` run it
(mixbits.measure.joint.JointEvaluator), on a float folder loaded as convert
loads it (lazily, cast to --dtype, patched).

    python bench/float_folder.py --shape llama-1b --out /tmp/llama1b       # once
    python bench/joint_profile.py --folder /tmp/llama1b --dtype float16

Times, each in this one process on the same folder:

- ``evaluations``: wall seconds of whole joint evaluations -- convert's
  timing probe's plan (one quantized tensor, the rest float), every tensor
  at one uniform candidate (first call: its layers built; second: cached),
  and the baseline guard's plans;
- ``ops``: one cached all-quantized evaluation again with an eval barrier
  around every leaf op (quantized / float linears by shape, attention,
  SwiGLU, norms, RoPE, embedding lookup, KL), so each op's time is its
  own; ``glue`` is what evaluating an op's inputs cost beyond the ops
  (residual adds, reshapes, casts), ``other`` what is left of the
  profiled evaluation (Python, the evaluator's bookkeeping);
- ``build``: seconds per (tensor, candidate) layer built.

The barriers cost a little fusion, so the profiled total is printed beside
the plain one. Numbers are wall seconds at the load recorded in ``host``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_float_linear import cpu_info  # noqa: E402


def _arrays(obj):
    if isinstance(obj, mx.array):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [a for o in obj for a in _arrays(o)]
    return []


class Profiler:
    """Eval barriers around leaf calls: seconds and calls per key."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.cpu = defaultdict(float)
        self.calls = defaultdict(int)
        self.flops = defaultdict(float)
        self.glue = 0.0
        self.active = False
        self._undo = []

    def wrap(self, owner, name, key_fn, flops_fn=None):
        orig = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        prof = self

        def wrapper(*args, **kwargs):
            if not prof.active:
                return orig(*args, **kwargs)
            t0 = time.perf_counter()
            mx.eval(*_arrays(args), *_arrays(list(kwargs.values())))
            t1, c1 = time.perf_counter(), time.process_time()
            out = orig(*args, **kwargs)
            mx.eval(*_arrays(out))
            t2, c2 = time.perf_counter(), time.process_time()
            key = key_fn(*args, **kwargs)
            prof.glue += t1 - t0
            prof.seconds[key] += t2 - t1
            prof.cpu[key] += c2 - c1
            prof.calls[key] += 1
            if flops_fn is not None:
                prof.flops[key] += flops_fn(*args, **kwargs)
            return out

        setattr(owner, name, wrapper)
        self._undo.append((owner, name, orig))

    def restore(self):
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)
        self._undo.clear()

    def table(self, total):
        rows = [{"op": k, "calls": self.calls[k], "seconds": round(s, 4),
                 "cpu_seconds": round(self.cpu[k], 4), "share": round(s / total, 4),
                 **({"gflops_wall": round(self.flops[k] / s / 1e9, 1),
                     "gflops_per_cpu_s": round(self.flops[k] / max(self.cpu[k], 1e-9) / 1e9, 1)}
                    if self.flops.get(k) else {})}
                for k, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])]
        return rows


def _rows(x):
    return int(np.prod(x.shape[:-1]))


def install(prof: Profiler, model):
    """Barriers on the leaf ops of a patched mlx-lm Llama-like model."""
    import mlx.nn as nn

    from mixbits import routing
    from mixbits.measure import joint
    from mixbits.nn.layers import MixedQuantizedEmbedding, MixedQuantizedLinear

    def qkey(self, x):
        qt = self.matmul_tensor()
        n, k = qt.shape
        kinds = "+".join(f"{b}b" for b, _, _ in self._layout.specs)
        return f"quantized linear {n}x{k} {kinds} x:{x.dtype}".replace("mlx.core.", "")

    prof.wrap(MixedQuantizedLinear, "__call__", qkey,
              lambda self, x: 2.0 * _rows(x) * self.matmul_tensor().shape[0] * x.shape[-1])
    prof.wrap(MixedQuantizedEmbedding, "__call__", lambda self, ids: "embedding lookup (quantized)")
    prof.wrap(routing._RoutedLinear, "__call__",
              lambda self, x: f"float linear {self['weight'].shape[0]}x{self['weight'].shape[1]} "
                              f"{self['weight'].dtype}".replace("mlx.core.", ""),
              lambda self, x: 2.0 * _rows(x) * self["weight"].shape[0] * x.shape[-1])
    prof.wrap(nn.Embedding, "__call__", lambda self, ids: "embedding lookup (float)")
    prof.wrap(routing._RoutedRMSNorm, "__call__", lambda self, x: "rms_norm")
    prof.wrap(routing._RoutedRoPE, "__call__", lambda self, x, offset=0: "rope")
    mod = sys.modules[type(model).__module__]
    prof.wrap(mod, "scaled_dot_product_attention", lambda q, *a, **k: "attention")
    prof.wrap(mod, "swiglu", lambda g, x: "swiglu")
    prof.wrap(joint, "kl_per_token", lambda r, q: "kl vs reference")


def timed(fn):
    """(wall seconds, process CPU seconds, result)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def profiled(model, fn):
    """One call of ``fn`` with barriers: (its table, wall s, CPU s, result, glue s, other s)."""
    prof = Profiler()
    install(prof, model)
    prof.active = True
    try:
        wall, cpu, out = timed(fn)
    finally:
        prof.active = False
        prof.restore()
    other = wall - sum(prof.seconds.values()) - prof.glue
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "glue_s": round(prof.glue, 4),
            "other_s": round(other, 4), "ops": prof.table(wall)}, out


def kinds_table(shapes=((5632, 2048), (2048, 5632)), m=256, dtype="float16") -> list[dict]:
    """Each candidate kind's layer at M rows of x (a one-sequence
    evaluation's), process CPU seconds per call: whether a kind (mixed
    segments with a permutation, ternary) takes a slower path."""
    import mlx.nn as nn

    from mixbits.measure.candidates import DEFAULT_CANDIDATES, build_layer, parse_candidate

    rows = []
    for n, k in shapes:
        lin = nn.Linear(k, n, bias=False)
        lin.weight = (mx.random.normal((n, k)) * 0.02).astype(getattr(mx, dtype))
        x = mx.random.normal((m, k)).astype(getattr(mx, dtype))
        mx.eval(lin.weight, x)
        for c in DEFAULT_CANDIDATES:
            layer = build_layer(lin, parse_candidate(c), mx.float16)
            mx.eval(layer.parameters())
            mx.eval(layer(x))
            cpu = []
            for _ in range(4):
                c0 = time.process_time()
                mx.eval(layer(x))
                cpu.append(time.process_time() - c0)
            med = float(np.median(cpu))
            rows.append({"shape": [n, k], "m": m, "kind": c, "cpu_ms": round(med * 1e3, 2),
                         "gflops_per_cpu_s": round(2.0 * m * n * k / med / 1e9, 1)})
            print(rows[-1], flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", default="/tmp/llama1b")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--n-seq", type=int, default=1)
    p.add_argument("--chunk", type=int, default=1)
    p.add_argument("--candidate", default="4b_g64")
    p.add_argument("--guard", nargs="*", default=["3b_g64", "3b_g64/4b_g64"],
                   help="extra plans: a uniform candidate, or low/high for mlx-lm's mixed recipe")
    p.add_argument("--out", default=None)
    p.add_argument("--kinds", action="store_true",
                   help="only the per-kind table of the quantized layer at M = 256 (kinds_table)")
    args = p.parse_args(argv)
    if args.kinds:
        out = {"host": {**cpu_info(), "load_avg_after": os.getloadavg()}, "rows": kinds_table()}
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        return

    from mixbits.measure.baselines import mixed_rule
    from mixbits.measure.calib import load_model
    from mixbits.measure.candidates import build_layer, parse_candidate
    from mixbits.measure.joint import JointEvaluator

    load_before = os.getloadavg()
    model, _ = load_model(types.SimpleNamespace(model=args.folder, dtype=args.dtype))
    tokens = np.load(Path(args.folder) / "tokens.npy")[: args.n_seq]
    evals = {}

    def run(label, fn):
        getattr(ev, "_scores", {}).clear()  # a repeated plan must run, not come from the memo
        wall, cpu, out = timed(fn)
        evals[label] = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3)}
        print(label, evals[label], flush=True)
        return out

    ev = None
    ev = run("reference logits (float forward)", lambda: JointEvaluator(model, tokens, chunk=args.chunk))
    sites = list(ev.sites.values())
    first = next(s for s in sites if s.block is not None)

    probe = {first.path: args.candidate}
    ev.joint_kl(probe)
    run("convert's probe plan (1 tensor quantized, the rest float), cached", lambda: ev.joint_kl(probe))

    full = {s.path: args.candidate for s in sites}
    n_before = len(ev._layers)
    kl_first = run(f"uniform {args.candidate}, first (builds its layers)", lambda: ev.joint_kl(full))
    built = len(ev._layers) - n_before
    kl = run(f"uniform {args.candidate}, cached", lambda: ev.joint_kl(full))
    assert kl == kl_first, (kl, kl_first)

    table = {"entries": [{"path": s.path} for s in sites]}
    for g in args.guard:
        if "/" in g:
            lo, hi = g.split("/")
            plan, name = mixed_rule(table, lo, hi, ev.adapter), f"mlx-lm mixed recipe {g}"
        else:
            plan, name = {s.path: g for s in sites}, f"uniform {g}"
        run(f"{name}, first", lambda: ev.joint_kl(plan))
        run(f"{name}, cached", lambda: ev.joint_kl(plan))

    getattr(ev, "_scores", {}).clear()
    quantized, kl_prof = profiled(model, lambda: ev.joint_kl(full))
    assert abs(kl_prof[0] - kl[0]) <= 1e-6 * max(1.0, abs(kl[0])), (kl_prof, kl)
    getattr(ev, "_scores", {}).clear()
    floated, _ = profiled(model, lambda: ev.joint_kl(probe))

    # Per (tensor, candidate) build cost: one tensor of each shape, again.
    builds = {}
    for s in sites:
        key = f"{tuple(s.shape)} {args.candidate}"
        if key not in builds:
            cand = parse_candidate(args.candidate)
            wall, cpu, _ = timed(lambda: mx.eval(build_layer(ev.originals[s.path], cand,
                                                             ev.scale_dtype).parameters()))
            builds[key] = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                           "ns_per_weight_cpu": round(cpu / int(np.prod(s.shape)) * 1e9, 1)}

    n_tok = int(tokens.size)
    linear_flops = sum(2.0 * n_tok * int(np.prod(s.shape)) for s in sites if s.form == "linear")
    result = {
        "host": {**cpu_info(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                 "mlx": mx.__version__, "MIXBITS_NUM_THREADS": os.environ.get("MIXBITS_NUM_THREADS")},
        "folder": args.folder, "dtype": args.dtype, "tokens": list(tokens.shape), "chunk": args.chunk,
        "tensors": len(sites), "layers_built_by_first_uniform": built,
        "linear_gflop_per_eval": round(linear_flops / 1e9, 1), "joint_kl": kl[0],
        "evaluations": evals,
        "profile_all_quantized": quantized,
        "profile_probe_plan": floated,
        "build_per_layer": builds,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
