"""One evaluation protocol for every quality claim (issue 41 item 1).

What every contender gets, and how each is scored:

- calibration: ``N_CAL`` x ``SEQ_LEN`` tokens of Botchan (the default
  corpus) per seed. Seed 0 is exactly what ``mixbits convert`` cuts by
  default (the first windows of the text); seed s > 0 is ``N_CAL`` windows
  drawn at random (numpy seed s) from the part of the text the in-domain
  held-out set does not use. Every calibrated contender (mixbits,
  dynamic_quant) of a seed gets the same token array.
- held out, never used for any choice:
  ``licenses``: ``HELD_N`` windows spread evenly over the license texts
  Debian ships (/usr/share/common-licenses: legal English, another text
  and register than the calibration prose) -- the score the claims use;
  ``botchan_story_tail``: the story's last ``HELD_N`` windows (before the
  Project Gutenberg license that ends the file), disjoint from every
  seed's calibration windows (same text, other passages): the gap
  between the two is how much of a loss is transfer rather than noise.
- reference: the model as loaded, in float32 (for SmolLM2 the GGUF's
  Q4_1 block linears dequantized); KL = mean per-token KL(ref || quantized)
  of the final logits; a sequence's score is its tokens' mean.
- storage bpw, one count for all: codes + an fp16 scale and bias per group
  (mlx-lm's count), summed over every tensor the allocation covers -- all
  linears in the blocks and the embedding, which SmolLM2 ties to the head
  (so the head is the embedding: one tensor, counted once, quantized by
  every contender). Norms and other small float tensors are left as they
  are by all and counted by none.
- ratio: contender A over contender B as the ratio of mean KLs (means over
  seeds and held-out sequences); 95% interval from a paired bootstrap that
  resamples held-out sequences (the same indices for both and for every
  seed). The spread over seeds is reported beside it, per seed.

Contenders built here (all on the same tensors, judged at storage bpw <=
the budget): uniform affine at 2/3/4/5/6/8 bits, group 32/64 (mlx-lm's
``convert -q`` with ``--q-bits/--q-group-size``); mlx-lm's ``mixed_*``
recipes via its own ``mixed_quant_predicate_builder`` (group 32/64);
mlx-lm's ``dynamic_quant`` (its ``estimate_sensitivities`` on the seed's
calibration tokens) at the width pairs in ``DQ_PAIRS``, its threshold set
at the budget; mixbits' default ``convert`` (one measurement per seed shared
by all budgets). With ``--kquant`` (bench/kquant.py; the llama.cpp tools from
bench/ggml/build_llama_quant.sh): llama.cpp's mixes Q2_K ... Q5_K_M from the
reference written as an F32 GGUF, with each seed's importance matrix
(llama-imatrix on the seed's tokens) and without; their storage bpw are the
bytes of the same tensors in the quantized GGUF (K-quant super-block scales
included, whatever type the mix gave each tensor); a mix over the largest
budget is only sized (no table row can use it), unless ``--kquant-all``.

Run:  nice -n 10 python bench/quality_protocol.py [--seeds 0 1] [--mixbits-seeds 0]
      [--budgets 3 3.5 4 4.5 5] [--work DIR]
Every stage is kept in --work (default /tmp/quality_protocol): a rerun
after a kill continues. Writes bench/results/quality_protocol_<model>.json.

A/B of mixbits' own settings on the same protocol: ``--method`` and
``--candidates`` are passed to ``convert`` (default: convert's own);
``--records-from`` takes the contenders' scores from another run's records
file (they do not depend on mixbits' settings; its mixbits rows are
dropped); ``--result`` names the results file; ``--n-cal`` gives every
seed fewer calibration sequences (the small-set case: seed 0 is still
convert's own cut, its first windows).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

N_CAL, SEQ_LEN, HELD_N = 8, 256, 16
# group 128 divides neither SmolLM2 (576) nor Gemma-3-270M (640) columns
BITS, GROUPS = (2, 3, 4, 5, 6, 8), (32, 64)
RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")
# dynamic_quant (low, high) bit pairs, group 64 as mlx-lm's defaults (4/5 is
# its default pair); each pair costs mlx-lm's backward passes per seed, ~4 min
# here, so four (3/8 and 2/4 scored 1.6-2.9x uniform's KL in convert_smollm2.json).
DQ_PAIRS = ((2, 3), (2, 4), (3, 5), (4, 5))
RESULTS = Path(__file__).parent / "results"

def host() -> dict:
    """CPU model, the ISA flags the kernels choose between, cores and load."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
                 platform.processor())
    flags = set(info.split())
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "asimd") if f in flags]
    return {"machine": platform.machine(), "cpu": model, "isa": isa, "cores": os.cpu_count(),
            "load_1min": os.getloadavg()[0]}

# ---------------------------------------------------------------- token sets

def _windows(tok, text: str) -> np.ndarray:
    ids = np.asarray(tok.encode(text), dtype=np.int64)
    n = len(ids) // SEQ_LEN
    return ids[: n * SEQ_LEN].reshape(n, SEQ_LEN)

def token_sets(tok, seeds, n_cal: int = N_CAL) -> tuple[dict[int, np.ndarray], dict[str, np.ndarray]]:
    """({seed: calibration [n_cal, SEQ_LEN]}, {held-out name: [HELD_N, SEQ_LEN]})."""
    from mixbits.models.calibration import calibration_text

    text = calibration_text("botchan")
    # the file ends with Project Gutenberg's license (~18 windows of legal
    # text): the in-domain set is the story's last windows before it
    end = text.find("End of Project Gutenberg")
    story = _windows(tok, text[:end] if end > 0 else text)
    legal = _windows(tok, calibration_text("licenses"))
    tail = len(story) - HELD_N  # story windows >= tail are the in-domain held-out set
    held = {"licenses": legal[np.linspace(0, len(legal) - 1, HELD_N).round().astype(int)],
            "botchan_story_tail": story[tail:]}
    calib = {}
    for s in seeds:
        # seed 0: convert's own cut (the first windows of the whole file)
        idx = np.arange(n_cal) if s == 0 else np.sort(np.random.default_rng(s).choice(tail, n_cal, replace=False))
        calib[s] = _windows(tok, text)[idx] if s == 0 else story[idx]
    return calib, held


# -------------------------------------------------------------- storage bits

def kind_bits(kind: str, shape) -> int:
    """Storage bits of one tensor [N, K] at a uniform affine ``kind``: codes
    + an fp16 scale and bias per group (mlx-lm's count; equal to the stored
    layer's bytes, which :meth:`Scorer.bpw` counts for other kinds)."""
    from mixbits.measure.candidates import parse_candidate

    return int(round(parse_candidate(kind).storage_bpw * int(np.prod(shape))))


def size_table(sites, kinds) -> dict:
    """A table-shaped dict (entries with candidates' storage_bits) over the
    tensors ``sites``, so baselines.entry_bpw and dynamic_quant.assignment
    count every contender's bits the same way."""
    entries = []
    for s in sites:
        n = int(np.prod(s.shape))
        entries.append({"path": s.path, "nparams": n,
                        "candidates": [{"kind": k, "storage_bits": kind_bits(k, s.shape)} for k in kinds]})
    return {"entries": entries}

# ------------------------------------------------------------------- scoring

class Scorer:
    """The reference model and one JointEvaluator per held-out set."""

    def __init__(self, model_name: str):
        import mixbits
        from mixbits.measure.calib import cast_model
        from mixbits.measure.joint import JointEvaluator
        from mixbits.nn import patch

        self.model, self.tok, _ = mixbits.load(model_name)
        cast_model(self.model, "float32")
        patch(self.model)
        self.seeds_calib, self.held = {}, {}
        _, self.held = token_sets(self.tok, [])
        # the second evaluator shares the first's layer cache (no calibrated
        # candidates here, so nothing is fitted on either set)
        self.evals, ev = {}, None
        for k, v in self.held.items():
            self.evals[k] = JointEvaluator(self.model, v, chunk=4, calibration=ev)
            ev = ev or self.evals[k]
        self.sites = [s for s in ev.adapter.sites]
        kinds = [f"{b}b_g{g}" for b in BITS for g in GROUPS]
        self.table = size_table(self.sites, kinds)

    def bpw(self, plan: dict[str, str]) -> float:
        from mixbits.measure.baselines import entry_bpw
        from mixbits.measure.candidates import parse_candidate
        from mixbits.measure.sweep import storage_bits

        kinds = {c["kind"] for c in self.table["entries"][0]["candidates"]}
        for k in sorted(set(plan.values()) - kinds):
            # a kind first seen here (mixbits' ternary, 4b10_3b ...): the built
            # layer's codes, scales, biases and permutation, as measure counts them
            uni = parse_candidate(k).kind == "uniform"
            ev = next(iter(self.evals.values()))
            for e, s in zip(self.table["entries"], self.sites):
                bits = kind_bits(k, s.shape) if uni else storage_bits(ev.layer(s.path, k), s)
                e["candidates"].append({"kind": k, "storage_bits": bits})
        return entry_bpw(self.table, plan)

    def score(self, plan: dict[str, str], sets=None, calibration=None) -> dict[str, list[float]]:
        """{held-out name: per-sequence KL} on ``sets`` (default: all). A plan
        with calibrated kinds (``+search``, ``+gptq``...) needs the tokens its
        allocation was calibrated on (``calibration``): its layers are fitted
        on them, never on the held-out text."""
        from mixbits.measure.candidates import parse_candidate

        evals = self.evals
        if any(parse_candidate(k).calibrated for k in set(plan.values())):
            if calibration is None:
                raise ValueError("a plan with calibrated kinds needs its calibration tokens")
            evals = self._fitted_on(np.asarray(calibration))
        return {k: ev.sequence_kls(plan).tolist() for k, ev in evals.items() if sets is None or k in sets}

    def _fitted_on(self, tokens: np.ndarray) -> dict:
        """Held-out evaluators whose calibrated layers are fitted on ``tokens``
        (one seed's set at a time: the previous seed's are let go)."""
        from mixbits.measure.joint import JointEvaluator

        if getattr(self, "_fit_tokens", None) is None or not np.array_equal(self._fit_tokens, tokens):
            self._fitted = None  # free the last seed's reference logits and layers first
            cal = JointEvaluator(self.model, tokens, chunk=4)
            # the held-out reference is the scorer's own (same model and tokens):
            # shared, not held twice (Gemma-3-270M: 2.1 GiB per set as probs16)
            self._fitted = {k: JointEvaluator(self.model, v, chunk=4, calibration=cal, same_reference=self.evals[k])
                            for k, v in self.held.items()}
            self._fit_tokens = tokens
        return self._fitted

def uniform_plans(sites) -> dict[str, dict[str, str]]:
    return {f"uniform {b}b_g{g}": {s.path: f"{b}b_g{g}" for s in sites} for b in BITS for g in GROUPS}

def recipe_plans(model, sites) -> dict[str, dict[str, str]]:
    """mlx-lm's mixed recipes, asked of its own predicate for each tensor path
    (with tied embeddings there is no lm_head: the embedding gets low bits, as
    mlx_lm.convert gives it)."""
    from mlx_lm.convert import mixed_quant_predicate_builder

    out = {}
    for r in RECIPES:
        for g in GROUPS:
            pred = mixed_quant_predicate_builder(r, model, group_size=g)
            plan = {}
            for s in sites:
                spec = pred(s.path, None)
                plan[s.path] = f"{spec['bits']}b_g{spec['group_size']}"
            out[f"mlx-lm {r} g{g}"] = plan
    return out

def finest_fitting(plans: dict[str, dict[str, str]], bpw, budgets) -> dict[str, dict[str, str]]:
    """Of each family (a width or a recipe, over group sizes), the finest
    group whose storage bpw fits each budget: the same widths with smaller
    groups at a higher bpw still within the budget are what a user would take
    (each evaluation costs ~1 min here, so the dominated ones are not run)."""
    keep = {}
    fam = {}
    for name, plan in plans.items():
        family, g = name.rsplit("g", 1) if name.startswith("mlx-lm") else name.rsplit("_g", 1)
        fam.setdefault(family, []).append((int(g), name, plan))
    for family, opts in fam.items():
        for b in budgets:
            fit = [(g, n, p) for g, n, p in opts if bpw(p) <= b + 1e-9]
            if fit:
                g, n, p = min(fit, key=lambda o: o[0])
                keep[n] = p
    return keep


def dq_plans(scorer: Scorer, calib: np.ndarray, budgets, cache: Path) -> dict[str, dict[str, str]]:
    """mlx-lm dynamic_quant at every DQ_PAIRS pair and budget, its
    sensitivities (kept in ``cache``) estimated on ``calib``."""
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities

    from mixbits.measure.dynamic_quant import assignment, float_copy
    from mixbits.nn import patch

    out = {}
    for lo, hi in DQ_PAIRS:
        f = cache / f"dq_sens_{lo}_{hi}.json"
        if not f.exists():
            t0 = time.perf_counter()
            # the float twin's linears on mixbits' float GEMM (same function and
            # gradients, tests/test_float_linear.py): MLX's Linux CPU matmul
            # takes ~25 min per 4 x 256-token batch here
            twin = float_copy(scorer.model)
            patch(twin)
            sens = dict(estimate_sensitivities(twin, mx.array(calib), lo, 64, hi, 64, batch_size=4))
            del twin
            f.write_text(json.dumps({"seconds": time.perf_counter() - t0, "sens": sens}))
        sens = json.loads(f.read_text())["sens"]
        lo_bpw = scorer.bpw({s.path: f"{lo}b_g64" for s in scorer.sites})
        hi_bpw = scorer.bpw({s.path: f"{hi}b_g64" for s in scorer.sites})
        for b in budgets:
            if not lo_bpw <= b < hi_bpw:  # all low does not fit, or all high does (uniform)
                continue
            out[f"mlx-lm dynamic_quant {lo}/{hi} @{b:g}"] = assignment(scorer.table, sens, b, f"{lo}b_g64",
                                                                      f"{hi}b_g64")
    return out

def run_convert(model_name: str, tokens: np.ndarray, budgets, out: Path, extra=()) -> float:
    """``mixbits convert`` with its defaults (or ``extra`` options) on
    ``tokens``; returns wall seconds of this call (the stage times over all
    runs are in out.work/timings.json)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tok_file = out.parent / "tokens.npy"
    np.save(tok_file, tokens)
    cmd = [sys.executable, "-m", "mixbits.cli", "convert", "--model", model_name,
           "--bpw", *[f"{b:g}" for b in budgets], "--tokens", str(tok_file), "--out", str(out), *extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0

def mixbits_plan(work: Path, bpw: float) -> tuple[dict[str, str], str]:
    alloc = json.loads((Path(str(work) + ".work") / f"allocation_{bpw:g}bpw.json").read_text())
    return {a["path"]: a["kind"] for a in alloc["assignment"]}, alloc.get("guard", {}).get("written", "?")

# ----------------------------------------------------------------- statistics

def ratio_ci(a: np.ndarray, b: np.ndarray, n: int = 10_000, seed: int = 0) -> tuple[float, list[float]]:
    """Ratio of mean KLs a / b and its paired-bootstrap 95% interval. ``a``,
    ``b``: [seeds, sequences] (a row per calibration seed; one row for a
    contender that does not depend on calibration is broadcast); resampling
    draws held-out sequences, the same for both and for every seed."""
    a, b = np.atleast_2d(a), np.atleast_2d(b)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.shape[1], (n, a.shape[1]))
    r = a[:, idx].mean(axis=(0, 2)) / b[:, idx].mean(axis=(0, 2))
    return float(a.mean() / b.mean()), [float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))]

def summarize(records: dict, budgets, seeds, mixbits_seeds, held: str = "licenses") -> list[dict]:
    """Per budget: mixbits' KL, the best contender (lowest mean KL over
    ``seeds`` at storage bpw <= budget) and the ratio with its interval."""
    rows = []
    for b in budgets:
        have = [s for s in mixbits_seeds if f"mixbits @{b:g} seed{s}" in records]
        ours = np.array([records[f"mixbits @{b:g} seed{s}"]["kl"][held] for s in have])
        cands = {}
        for name, r in records.items():
            if name.startswith("mixbits") or r["bpw"] > b + 1e-9 or held not in r["kl"]:
                continue
            if "@" in name:  # budget-specific (dynamic_quant): only this budget's
                base, at = name.rsplit(" @", 1)
                if not at.startswith(f"{b:g} "):
                    continue
            else:
                base = name.rsplit(" seed", 1)[0]
            # a calibrated contender's rows in ``seeds`` order (other seeds' rows left out),
            # so row i is seed seeds[i] whatever order the records were written in
            seed = int(name.rsplit(" seed", 1)[1]) if " seed" in name else None
            if seed is None or seed in seeds:
                cands.setdefault(base, []).append((-1 if seed is None else seeds.index(seed), r))
        scored = []
        for base, rows_ in cands.items():
            rs = [r for _, r in sorted(rows_, key=lambda x: x[0])]
            kl = np.array([r["kl"][held] for r in rs])
            scored.append((kl.mean(), base, kl, rs[0]["bpw"]))
        scored.sort(key=lambda x: x[0])
        row = {"budget": b, "held_out": held, "mixbits_seeds": have,
               "mixbits_kl": float(ours.mean()) if have else None,
               "mixbits_kl_per_seed": [float(x.mean()) for x in ours],
               "mixbits_bpw": [records[f"mixbits @{b:g} seed{s}"]["bpw"] for s in have],
               "mixbits_written": [records[f"mixbits @{b:g} seed{s}"].get("written") for s in have],
               "contenders": []}
        # the best four, and every llama.cpp mix that fits (its own table row)
        for m, base, kl, bpw in scored[:4] + [x for x in scored[4:] if x[1].startswith("llama.cpp")]:
            # pair mixbits' seeds with the contender's own (calibrated ones have a row per seed)
            c = {"name": base, "bpw": bpw, "kl": float(m), "kl_se": float(kl.std(ddof=1) / np.sqrt(kl.size))}
            if have:
                k = kl if kl.shape[0] == 1 else kl[[seeds.index(s) for s in have]]
                c["ratio"], c["ratio_ci95"] = ratio_ci(ours, k)
                if len(have) > 1:  # each seed alone: mixbits' row against the contender's same-seed row
                    c["ratio_per_seed"] = {}
                    for i, s in enumerate(have):
                        r, ci = ratio_ci(ours[i], k[0] if k.shape[0] == 1 else k[i])
                        c["ratio_per_seed"][str(s)] = {"ratio": r, "ci95": ci}
            row["contenders"].append(c)
        rows.append(row)
    return rows

# ------------------------------------------------------------------------ run

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--budgets", type=float, nargs="+", default=[3.0, 3.5, 4.0, 4.5, 5.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="calibration seeds (contenders)")
    ap.add_argument("--mixbits-seeds", type=int, nargs="*", default=None,
                    help="seeds mixbits convert runs on (default: --seeds)")
    ap.add_argument("--work", default="/tmp/quality_protocol")
    ap.add_argument("--skip-dq", action="store_true")
    ap.add_argument("--no-convert", action="store_true",
                    help="score the mixbits allocations already written (a convert running elsewhere)")
    ap.add_argument("--method", choices=("two-stage", "exact", "grad"),
                    help="convert's --method (default: convert's default)")
    ap.add_argument("--candidates", nargs="+", help="convert's --candidates (default: its 'default' preset)")
    ap.add_argument("--records-from", type=Path,
                    help="a records_<model>.json whose contender rows (not mixbits') are reused")
    ap.add_argument("--n-cal", type=int, default=N_CAL,
                    help=f"calibration sequences per seed (default {N_CAL}; fewer: the small-set case)")
    ap.add_argument("--result", type=Path, help="results file (default: results/quality_protocol_<model>.json)")
    ap.add_argument("--kquant", action="store_true",
                    help="add llama.cpp's K-quant mixes, with and without imatrix (bench/kquant.py)")
    ap.add_argument("--kquant-all", action="store_true",
                    help="score every K-quant mix; default: only those at storage bpw <= the largest budget "
                         "(the others' bpw and types are recorded, their KL is not run)")
    args = ap.parse_args()
    conv_opts = ([*(["--method", args.method] if args.method else []),
                  *(["--candidates", *args.candidates] if args.candidates else [])])
    mseeds = args.mixbits_seeds if args.mixbits_seeds is not None else args.seeds
    if not set(mseeds) <= set(args.seeds):
        raise SystemExit("--mixbits-seeds must be among --seeds")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rec_file = work / f"records_{args.model}.json"
    records = json.loads(rec_file.read_text()) if rec_file.exists() else {}
    if args.records_from:
        other = json.loads(args.records_from.read_text())
        records = {**{k: v for k, v in other.items() if not k.startswith("mixbits")}, **records}
    for r in records.values():  # an earlier "botchan_tail" was the Gutenberg license, not the story
        r["kl"].pop("botchan_tail", None)
    t_start = time.perf_counter()

    def save():
        tmp = rec_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(records))
        os.replace(tmp, rec_file)

    sc = Scorer(args.model)
    calib, _ = token_sets(sc.tok, args.seeds, args.n_cal)

    def add(name, plan, sets=None, calibration=None, **extra):
        want = [k for k in sc.held if sets is None or k in sets]
        have = records.get(name, {}).get("kl", {})
        missing = [k for k in want if k not in have]
        if not missing:
            return
        t0 = time.perf_counter()
        records[name] = {"bpw": sc.bpw(plan), "kl": {**have, **sc.score(plan, missing, calibration)}, **extra}
        print(f"{name}: bpw {records[name]['bpw']:.3f} KL "
              + " ".join(f"{k} {np.mean(v):.4f}" for k, v in records[name]["kl"].items())
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
        save()

    for name, plan in finest_fitting({**uniform_plans(sc.sites), **recipe_plans(sc.model, sc.sites)},
                                     sc.bpw, args.budgets).items():
        add(name, plan)
    timings = {}
    if not args.skip_dq:  # the cheap calibrated contenders first, every seed
        for s in args.seeds:
            sdir = work / f"seed{s}"
            sdir.mkdir(exist_ok=True)
            for name, plan in dq_plans(sc, calib[s], args.budgets, sdir).items():
                add(f"{name} seed{s}", plan, sets=["licenses"])  # the claim's set only: CPU is short
    if args.kquant:  # llama.cpp's mixes, scored from the GGUFs llama-quantize wrote
        import kquant

        sites = list(next(iter(sc.evals.values())).sites)
        for name, path in kquant.contenders(args.model, sc.tok, calib, work / "kquant"):
            if "licenses" not in records.get(name, {}).get("kl", {}):
                bpw, types = kquant.gguf_bpw(path, kquant.covered_names(path, sites))
                if bpw > max(args.budgets) + 1e-9 and not args.kquant_all:
                    # over every budget: no table row can use it; its size is kept, its KL not run
                    records[name] = {"bpw": bpw, "kl": {}, "ggml_types": types}
                    save()
                    continue
                t0 = time.perf_counter()
                records[name] = kquant.record(sc.evals, path, ["licenses"])  # the claim's set only, as dq
                print(f"{name}: bpw {records[name]['bpw']:.3f} KL licenses "
                      f"{np.mean(records[name]['kl']['licenses']):.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
                save()
    for s in mseeds:
        out = work / f"seed{s}" / args.model
        ready = [b for b in args.budgets if (Path(str(out) + ".work") / f"allocation_{b:g}bpw.json").exists()]
        if len(ready) < len(args.budgets) and not args.no_convert:
            run_convert(args.model, calib[s], args.budgets, out, conv_opts)
            ready = args.budgets
        tf = Path(str(out) + ".work") / "timings.json"
        timings[s] = json.loads(tf.read_text()) if tf.exists() else None
        used = np.load(Path(str(out) + ".work") / "tokens.npy")
        if not np.array_equal(used, calib[s]):
            raise SystemExit(f"{out}.work holds other calibration tokens than seed {s}'s")
        for b in ready:
            plan, written = mixbits_plan(out, b)
            add(f"mixbits @{b:g} seed{s}", plan, calibration=calib[s], written=written)
    result = {"host": host(), "model": args.model, "command": " ".join(sys.argv),
              "convert_options": conv_opts,
              "protocol": {"calibration": f"{args.n_cal} x {SEQ_LEN} Botchan tokens per seed (seed 0 = convert's "
                                          "default cut)", "seeds": args.seeds, "mixbits_seeds": mseeds,
                           "held_out": {k: list(v.shape) for k, v in sc.held.items()},
                           "bpw": "storage (codes + fp16 scale/bias per group) over all block linears and "
                                  "the (tied) embedding, the same tensors for every contender",
                           "reference": "the model as loaded, float32"},
              "mixbits_stage_wall_s": timings, "bench_wall_s_this_run": round(time.perf_counter() - t_start, 1),
              "summary": {h: summarize(records, args.budgets, args.seeds, mseeds, h) for h in sc.held},
              "records": records}
    if args.kquant:
        result["protocol"]["llama_cpp"] = {
            "bpw": "bytes of the same 211 tensors in the quantized GGUF (super-block scales included)",
            "reference": "every tensor of the model's GGUF decoded, written as F32 GGUF (bench/kquant.py)",
            "imatrix_tokens": {s: json.loads((work / "kquant" / f"calib_seed{s}_tokens.json").read_text())
                               for s in args.seeds}}
    out = args.result or RESULTS / f"quality_protocol_{args.model}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out)
    for r in result["summary"]["licenses"]:
        c = r["contenders"][0]
        if r["mixbits_kl"] is None:
            print(f"{r['budget']:g} bpw: best contender {c['name']} {c['kl']:.4f} ({c['bpw']:.3f} bpw)")
            continue
        per = "".join(f"; seed {s} {v['ratio']:.3f} [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}]"
                      for s, v in c.get("ratio_per_seed", {}).items())
        print(f"{r['budget']:g} bpw: mixbits {r['mixbits_kl']:.4f} vs {c['name']} {c['kl']:.4f} "
              f"({c['bpw']:.3f} bpw): {c['ratio']:.3f} [{c['ratio_ci95'][0]:.3f}, {c['ratio_ci95'][1]:.3f}]{per}")
    print(f"wrote {out}")

if __name__ == "__main__":
    main()
