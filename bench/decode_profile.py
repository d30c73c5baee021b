"""Where a SmolLM2-135M decode token goes, patched with mixbits, one thread,
CPU time: the plain step (``model(token, cache)``) next to the compiled one
(``mixbits.decode.Decoder``), each with mixbits' routed attention, SwiGLU,
RMSNorm and RoPE kernels (mixbits.routing, what ``patch`` installs) and
with MLX's own ops for those (``unpatch_functions``: the matmuls alone
patched), in one run.

    OPENBLAS_NUM_THREADS=1 python bench/decode_profile.py [--steps 32] [--reps 6]
        [--activations float|int8|int16] [--repack]

Per token:
- build: CPU time of the Python call that returns the (lazy) logits;
- eval: CPU time of ``mx.eval`` on them (MLX's own stream thread included,
  as ``time.process_time`` counts every thread of the process);
- within eval, measured apart on the same arrays: the model's 211 quantized
  matmuls (210 linears + the tied head, each as the model dispatches it,
  all in one graph) and the 30 decode attentions at this cache length (as
  the step runs them: the mixbits kernel, routed, over the filled keys --
  for the compiled step, kv_len over the buffer); "other" is the rest of
  eval (norms, rope, cache updates, reshapes, SwiGLU, and MLX's per-node
  dispatch);
- graph nodes: the primitives of one step's graph, by MLX op name, counted
  from ``mx.export_to_dot`` (noise-free, unlike the times).

Each round prefills the prompt afresh and decodes 2 untimed + ``--steps``
timed tokens (the compiled buffers hold prompt + those tokens, as in a
generation of that length). Times are medians over ``--reps`` rounds, the
steps interleaved round by round so load from other processes hits all alike;
the fastest token of each is reported too (noise only adds time). Saves
bench/results/decode_profile.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # read when MLX's BLAS loads

import argparse
import collections
import contextlib
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = 64
TEXT = "The quick brown fox jumps over the lazy dog while the capital of France is Paris. " * 8


def setup_cpu_one_thread():
    from mixbits import _ext

    mx.set_default_device(mx.cpu)
    _ext.set_max_threads(1)


def load_smollm2(patch: bool = True, activations: str = "float", repack: bool = False):
    import mixbits
    from mixbits.models import smollm2
    from mixbits.models.gguf import load_gguf

    model, tok, _ = load_gguf(smollm2.fetch())
    if patch:
        mixbits.patch(model, activations=activations, repack=repack)
    return model, tok


def prompt_ids(tok, n: int = PROMPT) -> list[int]:
    """The first n tokens of TEXT, repeated as often as n needs."""
    text = TEXT
    while len(ids := tok.encode(text)) < n:
        text += TEXT
    return ids[:n]


class Plain:
    """The model's own decode: ``model(token, cache)`` with mlx-lm caches."""

    name = "plain"
    routed = True  # mixbits' attention, SwiGLU, RMSNorm and RoPE kernels (mixbits.routing)

    def __init__(self, model, ids, capacity):
        from mlx_lm.models.cache import make_prompt_cache

        self.model, self.cache = model, make_prompt_cache(model)
        self.first = model(mx.array([ids]), cache=self.cache)
        mx.eval(self.first, [c.state for c in self.cache])

    def __call__(self, token):
        return self.model(token, cache=self.cache)

    def outputs(self, logits):
        return [logits]


class PlainMLXOps(Plain):
    """The plain step with MLX's own attention, norms, rope and SwiGLU
    (``mixbits.routing.unpatch_functions``): the matmuls alone patched."""

    name = "plain_mlx_ops"
    routed = False


class Compiled:
    """``mixbits.decode.Decoder``: the same forward, compiled."""

    name = "compiled"
    routed = True

    def __init__(self, model, ids, capacity):
        from mixbits.decode import Decoder

        self.dec = Decoder(model)
        self.first = self.dec.prefill(ids, capacity=capacity)
        mx.eval(self.first)

    def __call__(self, token):
        return self.dec.step(token)

    def outputs(self, logits):
        return [logits, *self.dec._state[0], *self.dec._state[1]]


class CompiledMLXOps(Compiled):
    """The compiled step with MLX's own ops (and the Decoder's rope stand-in)."""

    name = "compiled_mlx_ops"
    routed = False


@contextlib.contextmanager
def routing(model, routed: bool):
    """``model`` with or without mixbits' function routing, restored after."""
    from mixbits.routing import patch_functions, unpatch_functions

    if not routed:
        unpatch_functions(model)
    try:
        yield
    finally:
        if not routed:
            patch_functions(model)


def count_nodes(arrays) -> collections.Counter:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.dot")
        mx.export_to_dot(path, *arrays)
        text = Path(path).read_text()
    return collections.Counter(re.findall(r'\[label ="?([A-Za-z_]+)', text))


def warm(step, n: int = 2):
    """Greedy tokens through ``step`` (the first compiled one traces and checks)."""
    nxt = mx.argmax(step.first[:, -1:], axis=-1)
    for _ in range(n):
        nxt = mx.argmax(step(nxt)[:, -1:], axis=-1)
        mx.eval(nxt)
    return nxt


def time_steps(step, nxt, steps: int):
    """(build, eval) CPU seconds of each of ``steps`` greedy decode steps."""
    build, ev = [], []
    for _ in range(steps):
        t0 = time.process_time()
        logits = step(nxt)
        nxt = mx.argmax(logits[:, -1:], axis=-1)
        t1 = time.process_time()
        mx.eval(nxt)
        t2 = time.process_time()
        build.append(t1 - t0)
        ev.append(t2 - t1)
    return build, ev, nxt


def median_eval(build, reps: int) -> float:
    """Median CPU time of ``mx.eval`` on the arrays ``build()`` returns
    (the graph is built, untimed, before each evaluation)."""
    mx.eval(build())
    ts = []
    for _ in range(reps):
        out = build()
        t0 = time.process_time()
        mx.eval(out)
        ts.append(time.process_time() - t0)
    return statistics.median(ts)


def matmul_graph(model):
    """A function evaluating every quantized matmul of one decode token (the
    linears and the tied head, as the layers dispatch them) in one graph.
    Sibling layers (mixbits.siblings) get one x, as the model gives them,
    so a fused group computes once."""
    import mlx.nn as nn

    from mixbits.nn import MixedQuantizedEmbedding, MixedQuantizedLinear

    calls = []
    shared = {}  # sibling group -> the one x its members see, as in the model
    for _, m in model.named_modules():
        if isinstance(m, MixedQuantizedLinear):
            key = id(m.sibling_group) if m.sibling_group is not None else id(m)
            x = shared.setdefault(key, mx.random.normal((1, 1, m.input_dims)))
            calls.append((m, x))
        elif isinstance(m, nn.QuantizedLinear):
            calls.append((m, mx.random.normal((1, 1, m.weight.shape[1] * 32 // m.bits))))
        elif isinstance(m, (MixedQuantizedEmbedding, nn.QuantizedEmbedding)):
            calls.append((m.as_linear, mx.random.normal((1, 1, m.dims))))
    mx.eval([x for _, x in calls])
    return (lambda: [f(x) for f, x in calls]), len(calls)


def weight_bytes(model) -> int:
    """Bytes of every quantized module's arrays (codes, scales, biases):
    what one decode token must read."""
    from mlx.utils import tree_flatten

    total = 0
    for _, m in model.named_modules():
        if "Quantized" in type(m).__name__:
            total += sum(a.nbytes for _, a in tree_flatten(m.parameters()))
    return total


def attention_graph(model, length: int, capacity: int | None, routed: bool):
    """30 decode attentions (one per layer) as the step runs them. Routed:
    the mixbits kernel over the ``length`` keys (plain) or over the
    ``capacity``-slot buffer with kv_len (compiled); else MLX's sdpa with
    no mask (plain) or the boolean mask over the buffer (compiled)."""
    from mixbits import _ext

    layers = model.model.layers
    attn = layers[0].self_attn
    h, hk, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    s = capacity or length
    # The dtype attention sees (SmolLM2's GGUF: float16 embeddings, float32
    # after the first projection, whose scales are float32).
    dtype = attn.q_proj(model.model.embed_tokens(mx.array([[0]]))).dtype
    q = mx.random.normal((1, h, 1, d)).astype(dtype)
    kv = [(mx.random.normal((1, hk, s, d)).astype(dtype), mx.random.normal((1, hk, s, d)).astype(dtype))
          for _ in layers]
    n = mx.array(length, dtype=mx.int32)
    mask = None if capacity is None else mx.arange(s) <= length - 1
    mx.eval(q, kv, n, mask if mask is not None else q)
    if routed:
        kv_len = None if capacity is None else n
        return lambda: [_ext.causal_attention(q, k, v, attn.scale, 0, kv_len) for k, v in kv]
    sdpa = mx.fast.scaled_dot_product_attention
    return lambda: [sdpa(q, k, v, scale=attn.scale, mask=mask) for k, v in kv]


WARM = 2  # untimed first steps of a round (the compiled step's trace and check)


def rounds(model, ids, kinds, steps: int, reps: int) -> dict:
    """{kind name: (build seconds, eval seconds)} of every timed step:
    ``reps`` interleaved rounds, each from a fresh prefill of ``ids``, of
    WARM untimed + ``steps`` timed greedy steps."""
    capacity = len(ids) + WARM + steps + 1
    samples = {k.name: ([], []) for k in kinds}
    for _ in range(reps):
        for k in kinds:
            with routing(model, k.routed):
                m = k(model, ids, capacity)
                b, e, _ = time_steps(m, warm(m, WARM), steps)
            samples[k.name][0].extend(b)
            samples[k.name][1].extend(e)
    return samples


def profile(model, tok, steps: int, reps: int, patch_desc: str) -> dict:
    ids = prompt_ids(tok)
    # Each round decodes from a fresh prompt state, as a generation of
    # WARM + steps tokens would: the compiled buffers hold exactly that.
    capacity = PROMPT + WARM + steps + 1
    kinds = [PlainMLXOps, Plain, CompiledMLXOps, Compiled]
    nodes = {}
    for k in kinds:
        with routing(model, k.routed):
            m = k(model, ids, capacity)
            nodes[k.name] = count_nodes(m.outputs(m(warm(m))))
    from mixbits import _ext
    from mixbits.decode import _capacity  # the slots a compiled round's buffers have

    length = PROMPT + WARM + steps // 2  # the middle of the timed steps
    mm, n_mm = matmul_graph(model)
    pieces = {"qmatmul": mm}
    for routed in (True, False):
        pieces[("attention_plain", routed)] = attention_graph(model, length, None, routed)
        pieces[("attention_compiled", routed)] = attention_graph(model, length, _capacity(capacity), routed)
    # The pieces are timed inside every round too, so the subtraction
    # below compares times taken under the same load.
    samples = {k.name: ([], []) for k in kinds}
    piece_s = {name: [] for name in pieces}
    for _ in range(reps):
        for name, (b, e) in rounds(model, ids, kinds, steps, 1).items():
            samples[name][0].extend(b)
            samples[name][1].extend(e)
        for name, build in pieces.items():
            piece_s[name].append(median_eval(build, 3))
    t_mm = statistics.median(piece_s["qmatmul"])
    nbytes = weight_bytes(model)
    probe = float(_ext.read_bandwidth_gbps(1 << 28, 5))

    out = {}
    for k in kinds:
        build = statistics.median(samples[k.name][0])
        ev = statistics.median(samples[k.name][1])
        t_att = statistics.median(piece_s[("attention_compiled" if issubclass(k, Compiled) else "attention_plain",
                                           k.routed)])
        c = nodes[k.name]
        totals = [b + e for b, e in zip(*samples[k.name])]
        out[k.name] = {
            "ms_per_token": 1e3 * (build + ev),
            "tok_s": 1 / (build + ev),
            "ms_per_token_median_total": 1e3 * statistics.median(totals),
            "ms_per_token_min": 1e3 * min(totals),
            "build_ms": 1e3 * build,
            "eval_ms": 1e3 * ev,
            "qmatmul_ms": 1e3 * t_mm,
            "attention_ms": 1e3 * t_att,
            "other_eval_ms": 1e3 * (ev - t_mm - t_att),
            "graph_nodes": sum(c.values()),
            "nodes_by_op": dict(c.most_common()),
        }
    return {"model": f"SmolLM2-135M Q4_1 (GGUF), mixbits.patch({patch_desc})", "prompt": PROMPT,
            "steps": steps, "reps": reps, "untimed_first_steps": WARM, "compiled_capacity": _capacity(capacity), "quantized_matmuls": n_mm,
            "weight_mb": nbytes / 1e6, "qmatmul_gbps": nbytes / t_mm / 1e9, "probe_gbps": probe,
            "weights_at_probe_ms": 1e3 * nbytes / (probe * 1e9),
            "clock": "time.process_time, 1 thread (mixbits set_max_threads(1), OPENBLAS_NUM_THREADS=1)",
            "load_average": os.getloadavg()[0], "modes": out}


def report(res: dict) -> str:
    rows = [("tok/s", "tok_s", "{:.1f}"), ("ms/token", "ms_per_token", "{:.1f}"),
            ("  graph build (Python)", "build_ms", "{:.1f}"), ("  eval", "eval_ms", "{:.1f}"),
            ("    quantized matmuls", "qmatmul_ms", "{:.1f}"), ("    attention", "attention_ms", "{:.1f}"),
            ("    other (norm, rope, cache, dispatch)", "other_eval_ms", "{:.1f}"),
            ("graph nodes per token", "graph_nodes", "{}"),
            ("fastest token, ms (least disturbed)", "ms_per_token_min", "{:.1f}")]
    m = res["modes"]
    names = list(m)
    lines = [f"{res['model']}, prompt {res['prompt']}, {res['reps']} rounds of {res['untimed_first_steps']} + "
             f"{res['steps']} steps (compiled buffers: {res['compiled_capacity']} slots), "
             f"one thread CPU time (load average {res['load_average']:.2f})",
             f"{'':40}" + "".join(f" {n:>17}" for n in names)]
    lines += [f"{label:40}" + "".join(f" {fmt.format(m[n][k]):>17}" for n in names) for label, k, fmt in rows]
    lines.append(f"quantized weights {res['weight_mb']:.1f} MB per token: the matmul graph reads them at "
                 f"{res['qmatmul_gbps']:.1f} GB/s; read-bandwidth probe (1 thread) {res['probe_gbps']:.1f} GB/s "
                 f"-> {res['weights_at_probe_ms']:.1f} ms")
    for name in names:
        top = ", ".join(f"{k} {v}" for k, v in list(m[name]["nodes_by_op"].items())[:10])
        lines.append(f"{name} nodes: {top}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per round (default 32)")
    ap.add_argument("--reps", type=int, default=6, help="interleaved rounds (default 6)")
    ap.add_argument("--activations", default="float", choices=["float", "int8", "int16"],
                    help="the patched layers' CPU contract (mixbits.patch activations=)")
    ap.add_argument("--repack", action="store_true", help="patch(..., repack=True)")
    ap.add_argument("--out", default=None,
                    help="default results/decode_profile.json (float), else decode_profile_<act>[_repacked].json")
    a = ap.parse_args(argv)
    setup_cpu_one_thread()
    model, tok = load_smollm2(activations=a.activations, repack=a.repack)
    desc = f"activations={a.activations!r}" + (", repack=True" if a.repack else "")
    res = profile(model, tok, a.steps, a.reps, desc)
    if a.out is None:
        name = "decode_profile" if a.activations == "float" and not a.repack else \
            f"decode_profile_{a.activations}" + ("_repacked" if a.repack else "")
        a.out = str(RESULTS / f"{name}.json")
    print(report(res))
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"saved {a.out}")


if __name__ == "__main__":
    main()
