"""Seconds per tensor per quantizer (mixbits.quantizers) next to RTN.

Random weights and calibration inputs with planted outlier channels; the
Hessian X^T X is built outside the timing (the sweep's reference pass
accumulates it once per linear). AWQ's search runs on ``--awq-tokens`` of
the calibration tokens. Also records each quantizer's output error
||X W^T - X What^T|| / RTN's on those tokens, as a sanity check.

Run:
  OPENBLAS_NUM_THREADS=1 python bench/quantizers_cost.py > bench/results/quantizers_cost.json
"""
import argparse
import json
import os
import platform
import sys
import time

import mlx.core as mx
import numpy as np

from mixbits.quantizers import awq, gptq, rtn, search

p = argparse.ArgumentParser()
p.add_argument("--shapes", default="2048x2048,576x1536", help="N x K of each weight")
p.add_argument("--candidates", default="3b_g64,4b10_3b_g64")
p.add_argument("--tokens", type=int, default=4096)
p.add_argument("--awq-tokens", type=int, default=512)
p.add_argument("--repeat", type=int, default=2, help="best of this many runs")
args = p.parse_args()


def segments(name, k):
    from mixbits.measure.candidates import parse_candidate
    return parse_candidate(name).segments(k)


def timed(fn):
    """Best CPU time of the process (run with OPENBLAS_NUM_THREADS=1: one
    core's work, which other jobs on a shared machine do not inflate)."""
    best, out = float("inf"), None
    for _ in range(args.repeat):
        t = time.process_time()
        out = fn()
        mx.eval(*(out[0] if isinstance(out, tuple) else out).arrays())
        best = min(best, time.process_time() - t)
    return best, out


def dense(qt, inv=None):
    d = np.array(qt.dequantize(unpermute=True).astype(mx.float32)).astype(np.float64)
    return d if inv is None else d * np.array(inv)[None, :]


rows = []
for shape in args.shapes.split(","):
    n, k = map(int, shape.split("x"))
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    x = rng.standard_normal((args.tokens, k)).astype(np.float32)
    x[:, rng.choice(k, max(1, k // 100), replace=False)] *= 20
    x64 = x.astype(np.float64)
    H = x64.T @ x64
    xs = x[: args.awq_tokens]
    xm = np.abs(x).mean(0)
    for cand in args.candidates.split(","):
        segs = segments(cand, k)
        mixed = len(segs) > 1
        perm = np.argsort(-np.linalg.norm(w, axis=0), kind="stable") if mixed else None  # the codec's rule
        runs = {
            "rtn": lambda: rtn(w, segs, perm, mx.float16),
            "search": lambda: search(w, segs, perm, mx.float16, h_diag=np.diag(H)),
            "awq": lambda: awq(w, segs, xm, xs, dtype=mx.float16, perm=perm),
            "gptq": lambda: gptq(w, segs, H, dtype=mx.float16, n_tokens=len(x)),
            "gptq_search_params": lambda: gptq(w, segs, H, dtype=mx.float16, n_tokens=len(x), params="search"),
            "gptq_no_act_order": lambda: gptq(w, segs, H, perm=perm, act_order=False, dtype=mx.float16,
                                              n_tokens=len(x)),
        }
        res, e_rtn = {}, None
        for name, fn in runs.items():
            sec, out = timed(fn)
            d = dense(*out) if isinstance(out, tuple) else dense(out)
            e = float(np.linalg.norm(xs.astype(np.float64) @ (w - d).T))
            e_rtn = e if name == "rtn" else e_rtn
            res[name] = {"seconds": round(sec, 3), "output_error_vs_rtn": round(e / e_rtn, 4)}
            print(f"{shape} {cand} {name}: {sec:.3f}s, error/RTN {e / e_rtn:.3f}", file=sys.stderr)
        rows.append({"shape": [n, k], "candidate": cand, "quantizers": res})

print(json.dumps({
    "command": "OPENBLAS_NUM_THREADS=" + os.environ.get("OPENBLAS_NUM_THREADS", "(unset)")
               + " python bench/quantizers_cost.py " + " ".join(sys.argv[1:]),
    "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), numpy {np.__version__}, mlx {mx.__version__}",
    "notes": "best of --repeat runs, CPU seconds of the process (OPENBLAS_NUM_THREADS=1), fp16 scales; H = X^T X built outside the timing; "
             "awq searches 21 alphas on --awq-tokens tokens; error measured on those tokens",
    "tokens": args.tokens, "awq_tokens": args.awq_tokens,
    "results": rows,
}, indent=1))
