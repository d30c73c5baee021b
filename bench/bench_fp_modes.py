"""Speed of the fp-mode CPU kernels (cpp/fpmatmul: mxfp4, nvfp4, mxfp8) on
one thread: mixbits.quantized_matmul against mx.quantized_matmul in the
same mode (transpose=True, and transpose=False at M = 1 and 32: the x
gradient's product), against mixbits' affine 4-bit g64 kernel on the same
shape, and as weight GB/s against a one-thread read-bandwidth probe
(cpp/bench/probe.cpp) measured in the same run.

    OPENBLAS_NUM_THREADS=1 python bench/bench_fp_modes.py [--quick] [--out bench/results/fp_modes_speed.json]

CPU time of the process (time.process_time), median of repeated calls
after a warm-up; MLX's CPU fp path is scalar, so its larger-M calls are
estimated from M = 1 and skipped above a budget (recorded as skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import mlx.core as mx
import numpy as np

import mixbits
from mixbits import _ext, ops

MODES = {"mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
SHAPES = [(4096, 4096), (1024, 1024)]  # (N, K)
MS = [1, 32, 256]
MLX_BUDGET_S = 2.0
PROBE_BYTES = 256 << 20  # far larger than the last-level cache


def cpu_model() -> tuple[str, list[str]]:
    model, flags = platform.processor() or "?", []
    if os.path.exists("/proc/cpuinfo"):
        text = open("/proc/cpuinfo").read()
        for line in text.splitlines():
            if line.startswith("model name") and model in ("?", "x86_64", ""):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = sorted(f for f in have if f.startswith(("avx", "fma", "f16c")))
                break
    return model, flags


def time_call(fn, min_time=0.3, max_reps=50, min_reps=3) -> float:
    """Median CPU seconds of one call (after a warm-up call)."""
    fn()
    ts, start = [], time.process_time()
    while len(ts) < max_reps and (len(ts) < min_reps or time.process_time() - start < min_time):
        t0 = time.process_time()
        fn()
        ts.append(time.process_time() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def weights(n, k, mode, rng):
    w = mx.array((rng.standard_normal((n, k)) * 0.02).astype(np.float32))
    if mode == "affine":
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
    else:
        (wq, s), b = mx.quantize(w, mode=mode), None
    mx.eval(wq, s, *([b] if b is not None else []))
    nbytes = wq.nbytes + s.nbytes + (b.nbytes if b is not None else 0)
    return wq, s, b, nbytes


def bench_case(n, k, m, mode, rng, rows, transpose=True):
    """transpose=False: y = x @ W with the same stored W (N rows of K): x
    has N columns (the gradient wrt x of the transposed product)."""
    wq, s, b, nbytes = weights(n, k, mode, rng)
    x = mx.array(rng.standard_normal((m, k if transpose else n)).astype(np.float32))
    mx.eval(x)
    ours = lambda: mx.eval(mixbits.quantized_matmul(x, wq, s, b, mode=mode, transpose=transpose))
    mlx = lambda: mx.eval(mx.quantized_matmul(x, wq, s, b, mode=mode, transpose=transpose))
    row = {"mode": mode, "transpose": transpose, "N": n, "K": k, "M": m, "weight_bytes": nbytes,
           "bpw": 8.0 * nbytes / (n * k)}
    t = time_call(ours)
    row["mixbits_ms"] = t * 1e3
    row["mixbits_gbps"] = nbytes / t / 1e9
    # MLX at M = 1 first; larger M estimated linearly and skipped if too slow.
    x1 = x[:1]
    t1 = time_call(lambda: mx.eval(mx.quantized_matmul(x1, wq, s, b, mode=mode, transpose=transpose)),
                   min_time=0.1, max_reps=5)
    if t1 * m > MLX_BUDGET_S:
        row["mlx_ms"] = None
        row["mlx_skipped"] = f"estimated {t1 * m:.1f} s per call from M=1"
    else:
        tm = t1 if m == 1 else time_call(mlx, min_time=0.2, max_reps=10)
        row["mlx_ms"] = tm * 1e3
        row["speedup_vs_mlx"] = tm / t
    rows.append(row)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the 1024x1024 shape only")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    prev = _ext.max_threads()
    _ext.set_max_threads(1)  # one thread: kernels and probe alike
    try:
        model, flags = cpu_model()
        probe = float(_ext.read_bandwidth_gbps(PROBE_BYTES, 5))
        print(f"CPU: {model}\nflags: {' '.join(flags)}\nfp backends: {ops.available_fp_backends()}"
              f"\none-thread read probe: {probe:.1f} GB/s over {PROBE_BYTES >> 20} MiB")
        rng = np.random.default_rng(0)
        rows = []
        shapes = SHAPES[1:] if args.quick else SHAPES
        print(f"\n{'mode':>7} {'N x K':>11} {'M':>4} {'mixbits ms':>11} {'GB/s':>6} {'% probe':>8} "
              f"{'MLX ms':>9} {'x MLX':>7} {'x affine4':>9}")
        for n, k in shapes:
            for m in MS:
                case_rows = [bench_case(n, k, m, mode, rng, rows) for mode in ["affine", *MODES]]
                aff = case_rows[0]["mixbits_ms"]
                for r in case_rows:
                    r["pct_probe"] = 100.0 * r["mixbits_gbps"] / probe
                    r["time_over_affine4"] = r["mixbits_ms"] / aff
                    mlx_ms = f"{r['mlx_ms']:.2f}" if r["mlx_ms"] is not None else "skip"
                    sp = f"{r['speedup_vs_mlx']:.1f}" if "speedup_vs_mlx" in r else "-"
                    print(f"{r['mode']:>7} {n:>5}x{k:<5} {m:>4} {r['mixbits_ms']:>11.3f} "
                          f"{r['mixbits_gbps']:>6.2f} {r['pct_probe']:>7.0f}% {mlx_ms:>9} {sp:>7} "
                          f"{r['time_over_affine4']:>9.2f}")
        # transpose=False (x @ W, the x gradient's product): the fp modes only
        # (affine transpose=False runs MLX's op in mixbits too)
        print(f"\ntranspose=False\n{'mode':>7} {'N x K':>11} {'M':>4} {'mixbits ms':>11} {'GB/s':>6} "
              f"{'% probe':>8} {'MLX ms':>9} {'x MLX':>7}")
        for n, k in shapes:
            for m in MS[:2]:
                for mode in MODES:
                    r = bench_case(n, k, m, mode, rng, rows, transpose=False)
                    r["pct_probe"] = 100.0 * r["mixbits_gbps"] / probe
                    mlx_ms = f"{r['mlx_ms']:.2f}" if r["mlx_ms"] is not None else "skip"
                    sp = f"{r['speedup_vs_mlx']:.1f}" if "speedup_vs_mlx" in r else "-"
                    print(f"{mode:>7} {n:>5}x{k:<5} {m:>4} {r['mixbits_ms']:>11.3f} {r['mixbits_gbps']:>6.2f} "
                          f"{r['pct_probe']:>7.0f}% {mlx_ms:>9} {sp:>7}")
        if args.out:
            data = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "cpu": model,
                    "flags": flags, "platform": platform.platform(), "threads": 1,
                    "clock": "process_time, median", "probe_gbps_1thread": probe,
                    "loadavg_at_end": list(os.getloadavg()), "rows": rows,
                    "notes": ["affine = mixbits' affine 4-bit g64 kernel on the same shape",
                              "x MLX = mx.quantized_matmul time / mixbits time, same mode",
                              "GB/s = packed weight bytes (codes + scales [+ biases]) / time"]}
            tmp = args.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, args.out)
    finally:
        _ext.set_max_threads(prev)


if __name__ == "__main__":
    main()
