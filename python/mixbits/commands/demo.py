"""``mixbits demo``: quantize a random matrix several ways, including mixed
segments with an act-order permutation, and report error and storage."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np


def add_arguments(p) -> None:
    p.add_argument("--n", type=int, default=1024, help="output features N (default 1024)")
    p.add_argument("--k", type=int, default=4096, help="input features K (default 4096)")
    p.add_argument("--m", type=int, default=8, help="activation rows M (default 8)")
    p.add_argument("--seed", type=int, default=0)


def _salience_order(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    # Columns that meet large activations matter most: sort by E[x^2]*|w|^2.
    score = (x.astype(np.float64) ** 2).mean(0) * (w.astype(np.float64) ** 2).sum(0)
    return np.argsort(-score).astype(np.int32)


def run(args) -> int:
    import mixbits

    n, k, m = args.n, args.k, args.m
    if k % 128 or k < 128 or n < 1 or m < 1:
        raise SystemExit(f"--k must be a positive multiple of 128 and --n, --m positive; got {k}, {n}, {m}")
    rng = np.random.default_rng(args.seed)
    w = rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)
    # Activations with a few loud channels, as in real LLM layers.
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, rng.choice(k, k // 50, replace=False)] *= 8.0
    wm, xm = mx.array(w), mx.array(x)
    y_ref = x.astype(np.float64) @ w.astype(np.float64).T

    perm = _salience_order(w, x)
    k_hi = max(128, (k // 10) // 128 * 128)  # about 10% of the columns, whole groups
    k_mid = (k - k_hi) // 2 // 128 * 128
    configs = [
        ("8-bit g64", [(8, 64, k)], None),
        ("4-bit g64", [(4, 64, k)], None),
        ("3-bit g64", [(3, 64, k)], None),
        ("2-bit g32", [(2, 32, k)], None),
        ("ternary g64", [("ternary", 64, k)], None),
    ]
    if k - k_hi > 0:
        configs.append(("mixed 4b(10%)+3b, act-order", [(4, 64, k_hi), (3, 64, k - k_hi)], perm))
    if k_mid > 0 and k - k_hi - k_mid > 0:
        configs.append(("mixed 6b(10%)+4b+2b, act-order",
                        [(6, 32, k_hi), (4, 64, k_mid), (2, 64, k - k_hi - k_mid)], perm))
    print(f"W: {n} x {k} float32, x: {m} x {k}; error of y = x @ W.T vs float64")
    print(f"{'tensor':34s} {'bpw':>6s} {'rel err W':>10s} {'rel err y':>10s} {'qmatmul ms':>11s}")
    for name, segs, p in configs:
        qt = mixbits.quantize(wm.astype(mx.float16), segs, perm=p)
        w_hat = np.array(qt.dequantize(unpermute=True).astype(mx.float32))
        err_w = np.linalg.norm(w_hat - w) / np.linalg.norm(w)
        y = mixbits.qmatmul(xm, qt)
        mx.eval(y)
        t0 = time.perf_counter()
        y = mixbits.qmatmul(xm, qt)
        mx.eval(y)
        dt = (time.perf_counter() - t0) * 1e3
        err_y = np.linalg.norm(np.array(y, dtype=np.float64) - y_ref) / np.linalg.norm(y_ref)
        print(f"{name:34s} {qt.bits_per_weight:6.3f} {err_w:10.4f} {err_y:10.4f} {dt:11.2f}")
    print(f"CPU backends here: {', '.join(mixbits.ops.available_backends())}; "
          f"threads: {mixbits._ext.num_threads()}")
    return 0
