"""Per-dot error of activations="int8" against float64 on random inputs,
and its ratio to the documented bound (bench/INT8.md). Writes
bench/results/int8_error.json.

    python bench/int8_error.py
    # int8-all at a prompt's rows, on the repacked layout:
    python bench/int8_error.py --activations int8-all --m 128 --repack \
        --out bench/results/int8_all_error.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

import mixbits


def dequant64(qt):
    parts = [np.array(mx.dequantize(s.wq, s.scales.astype(mx.float32), s.biases.astype(mx.float32),
                                    group_size=s.group_size, bits=s.bits), np.float64)
             for s in qt.segments]
    return np.concatenate(parts, 1)


def one(bits, gs, xkind, rng, n=512, k=4096, m=16, act="int8", repack=False):
    w = rng.standard_normal((n, k)).astype(np.float32)
    qt = mixbits.quantize(mx.array(w).astype(mx.float16), [(bits, gs, k)])
    if xkind == "gaussian":
        x = rng.standard_normal((m, k))
    elif xkind == "student-t3":  # heavy tails: a few large entries per group
        x = rng.standard_t(3, (m, k))
    else:  # outlier channels, as in LLM hidden states: 1% of columns x30
        x = rng.standard_normal((m, k))
        x[:, rng.choice(k, k // 100, replace=False)] *= 30
    x = x.astype(np.float32)
    W = dequant64(qt)
    y64 = x.astype(np.float64) @ W.T
    w_run = mixbits.ops.repack(qt) if repack else qt
    y = np.array(mixbits.qmatmul(mx.array(x), w_run, activations=act), np.float64)
    yf = np.array(mixbits.qmatmul(mx.array(x), qt), np.float64)
    err = np.abs(y - y64)
    g = np.abs(x).reshape(m, -1, gs).max(-1)
    d = np.repeat(g / np.float32(127), gs, 1).astype(np.float64)
    bound = (d / 2 + 2.0**-22 * np.abs(x)) @ np.abs(W).T
    mag = np.abs(x).astype(np.float64) @ np.abs(W).T
    rms_y = np.sqrt((y64**2).mean())
    return {
        "bits": bits, "group_size": gs, "x": xkind, "K": k,
        "rel_to_sum_abs_median": float(np.median(err / mag)),
        "rel_to_sum_abs_max": float((err / mag).max()),
        "rel_to_rms_y_median": float(np.median(err) / rms_y),
        "rel_to_rms_y_p99": float(np.quantile(err, 0.99) / rms_y),
        "float_path_rel_to_rms_y_max": float(np.abs(yf - y64).max() / rms_y),
        "err_over_bound_max": float((err / bound).max()),
    }


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--activations", default="int8", choices=["int8", "int8-all"])
    ap.add_argument("--m", type=int, default=16, help="x rows (int8 runs the float path above 16)")
    ap.add_argument("--repack", action="store_true", help="run on the repacked layout")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "int8_error.json"))
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = [one(b, g, xk, rng, m=a.m, act=a.activations, repack=a.repack)
            for xk in ("gaussian", "student-t3", "outlier-channels")
            for b in (2, 4, 8) for g in (32, 64, 128)]
    hdr = f"{'x':>16} {'bits':>4} {'g':>4} {'med err/Σ|wx|':>14} {'max err/Σ|wx|':>14} {'med err/rms y':>14} {'p99 err/rms y':>14} {'max err/bound':>13}"
    print(hdr)
    for r in rows:
        print(f"{r['x']:>16} {r['bits']:>4} {r['group_size']:>4} {r['rel_to_sum_abs_median']:14.2e} "
              f"{r['rel_to_sum_abs_max']:14.2e} {r['rel_to_rms_y_median']:14.2e} {r['rel_to_rms_y_p99']:14.2e} "
              f"{r['err_over_bound_max']:13.3f}")
    Path(a.out).write_text(json.dumps({"rows": rows, "M": a.m, "N": 512, "activations": a.activations,
                                       "repacked": a.repack}, indent=1) + "\n")


if __name__ == "__main__":
    main()
