"""Refine's joint evaluations before/after the reuse of issue 40 (an
assignment scored before is not rerun; blocks before the first changed one
are stubbed by stored outputs): the real ``refine`` (knapsack starts,
swaps, baseline guard) on a float folder, for two budgets on one evaluator
as convert runs them, from a synthetic sensitivity table (per-tensor KL =
s_i * 4^-bits, s_i log-normal: the search's moves, not its quality, are
what is timed here).

    python bench/joint_reuse.py --folder /tmp/llama1b                 # this tree's code
    python /path/to/run_with_other_checkout.py bench/joint_reuse.py ... # the code before

Each run prints one JSON object: the layers are built first (not timed: the
same work before and after), then wall and process CPU seconds of the two
refines, the evaluations run / answered from stored scores, the block calls
run / stubbed, and every joint KL the search saw (equal before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_float_linear import cpu_info  # noqa: E402

CANDS = ("2b_g64", "3b_g64", "4b_g64", "8b_g64")


def synthetic_table(sites, seed=0) -> dict:
    from mixbits.measure.candidates import parse_candidate

    rng = np.random.default_rng(seed)
    entries = []
    for s in sites:
        sens = float(rng.lognormal(0.0, 1.0))
        cands = []
        for name in CANDS:
            c = parse_candidate(name)
            cands.append({"kind": name, "bits": c.bits, "kl": sens * 4.0 ** -c.bits,
                          "storage_bits": int(round(c.storage_bpw * s.nparams))})
        entries.append({"path": s.path, "layer": s.block, "nparams": s.nparams, "candidates": cands})
    return {"entries": entries}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", default="/tmp/llama1b")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--n-seq", type=int, default=1)
    p.add_argument("--chunk", type=int, default=4)
    p.add_argument("--bpw", type=float, nargs="+", default=[3.5, 4.0])
    p.add_argument("--max-evals", type=int, default=8)
    p.add_argument("--label", default="")
    args = p.parse_args(argv)

    import mixbits
    from mixbits.measure.calib import load_model
    from mixbits.measure.joint import JointEvaluator
    from mixbits.measure.refine import refine

    load_before = os.getloadavg()
    model, _ = load_model(types.SimpleNamespace(model=args.folder, dtype=args.dtype))
    tokens = np.load(Path(args.folder) / "tokens.npy")[: args.n_seq]
    ev = JointEvaluator(model, tokens, chunk=args.chunk)
    table = synthetic_table(list(ev.sites.values()))
    for e in table["entries"]:  # build every layer up front: not what is compared
        for c in CANDS:
            ev.layer(e["path"], c)
    seen = []
    inner = ev.joint_kl

    def recording(assignment, chunks=None):
        out = inner(assignment, chunks)
        seen.append(out[0])
        return out

    ev.joint_kl = recording
    w0, c0 = time.perf_counter(), time.process_time()
    per_budget = {}
    for b in args.bpw:
        t, c = time.perf_counter(), time.process_time()
        alloc = refine(table, ev, b, max_evals=args.max_evals, progress=False)
        per_budget[str(b)] = {"wall_s": round(time.perf_counter() - t, 2),
                              "cpu_s": round(time.process_time() - c, 2),
                              "written": alloc["guard"]["written"],
                              "joint_kl": alloc["guard"]["joint_kl"]}
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    out = {
        "label": args.label, "mixbits": str(Path(mixbits.__file__).parent),
        "host": {**cpu_info(), "load_avg_before": load_before, "load_avg_after": os.getloadavg()},
        "folder": args.folder, "dtype": args.dtype, "tokens": list(tokens.shape), "chunk": args.chunk,
        "budgets": args.bpw, "max_evals": args.max_evals,
        "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "per_budget": per_budget,
        "joint_kl_calls": len(seen),
        "forwards_run": ev.evaluations,
        "scores_reused": getattr(ev, "reused", 0),
        "blocks_run": getattr(ev, "blocks_run", None),
        "blocks_skipped": getattr(ev, "blocks_skipped", None),
        "reuse_reason": getattr(ev, "reuse_reason", "not in this code"),
        "joint_kls": seen,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
