"""activations="int8" and "int16" against their baselines, one run, one
thread, CPU time: mixbits int8 and int16 (widest integer dot this CPU has,
and the AVX2-only kernels),
the mixbits float path, mx.quantized_matmul and numpy float32 sgemm on the
dequantized weights; plus the read-bandwidth probe (1 thread). Shapes
4096x4096, 11008x4096, 4096x11008; 2/3/4/8-bit g64; M = 1, 2, 4, 8, 16.
Writes bench/results/int8_1thread_cpu.json and prints the table.

    OPENBLAS_NUM_THREADS=1 env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \\
        python bench/bench_int8.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mixbits
from mixbits import _ext
from mixbits.commands import bench as qb

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]
KINDS = ["2bit", "3bit", "4bit", "8bit"]
MS = [1, 2, 4, 8, 16]
INTS = ["int8", "int16"]


def cpu_flags() -> list[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                want = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni"]
                return [f for f in want if f in have]
    except OSError:
        pass
    return [platform.machine()]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4096x4096 only")
    ap.add_argument("--min-time", type=float, default=0.25)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "int8_1thread_cpu.json"))
    a = ap.parse_args(argv)
    mx.set_default_device(mx.cpu)
    _ext.set_max_threads(1)
    qb.CLOCK = time.process_time
    flags = cpu_flags()
    probe = float(_ext.read_bandwidth_gbps(1 << 30, 5))
    print(f"CPU flags: {' '.join(flags)}; OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}")
    print(f"read-bandwidth probe (1 thread): {probe:.1f} GB/s; one thread, CPU time (median)")
    rows = []
    hdr = (f"{'N x K':>11} {'bits':>4} {'M':>3} {'int8 ms':>8} {'avx2 ms':>8} {'int16 ms':>8} "
           f"{'avx2 ms':>8} {'float ms':>8} {'MLX ms':>8} {'numpy ms':>8} {'f/i8':>5} {'f/i16':>5} "
           f"{'MLX/i8':>6} {'np/i8':>6} {'%probe':>6}")
    print(hdr + "\n" + "-" * len(hdr))
    for n, k in (SHAPES[:1] if a.quick else SHAPES):
        for kind in KINDS:
            wt = qb.Weights(n, k, kind)
            for m in MS:
                x = qb.make_x(qb.Case(n, k, m, kind))
                base = qb.runners(wt, x)
                fns = {}
                for c in INTS:
                    fns[c] = lambda c=c: mx.eval(mixbits.qmatmul(x, wt.qt, activations=c))
                    fns[c + "_avx2"] = lambda c=c: mx.eval(mixbits.qmatmul(x, wt.qt, activations=c, backend="avx2"))
                fns.update(float=base["mixbits"], mlx=base["mlx"], numpy=base["numpy"])
                t = {name: qb.time_call(fn, a.min_time, max_reps=100 if name != "mlx" else 5)
                     for name, fn in fns.items()}
                ms = {name: v["best_s"] * 1e3 for name, v in t.items()}
                gbps = wt.nbytes / (ms["int8"] * 1e-3) / 1e9
                rows.append({"n": n, "k": k, "bits": int(kind[:-3]), "group_size": 64, "m": m,
                             "weight_bytes": wt.nbytes, "times": t, "ms": ms,
                             "pct_probe_int8": 100 * gbps / probe})
                print(f"{n:>5}x{k:<5} {kind[:-3]:>4} {m:>3} {ms['int8']:8.3f} {ms['int8_avx2']:8.3f} "
                      f"{ms['int16']:8.3f} {ms['int16_avx2']:8.3f} "
                      f"{ms['float']:8.3f} {ms['mlx']:8.2f} {ms['numpy']:8.3f} "
                      f"{ms['float'] / ms['int8']:5.2f} {ms['float'] / ms['int16']:5.2f} "
                      f"{ms['mlx'] / ms['int8']:6.1f} "
                      f"{ms['numpy'] / ms['int8']:6.2f} {100 * gbps / probe:5.0f}%", flush=True)
    out = {"cpu_flags": flags, "probe_gbps_1thread": probe, "clock": "process_time, median",
           "threads": 1, "int8_kernel": "avx512vnni" if "avx512_vnni" in flags else "avx2",
           "load_average": os.getloadavg(), "mlx": mx.__version__, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
