"""activations="int8-all" on a repacked weight: the blocked int8 GEMM
(cpp/qmatmul_int8/repacked_vnni_gemm.cpp) against the GEMV in passes of 8
rows, alternating in one process (one thread, CPU time, median of
repetitions), to choose kRepackGemmMinM (repack.h) from a measurement.
Writes bench/results/int8_gemm_crossover_1thread_cpu.json.

    OPENBLAS_NUM_THREADS=1 MIXBITS_NUM_THREADS=1 python bench/int8_gemm_crossover.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mixbits
from mixbits import _ext, ops

SHAPES = [(4096, 4096), (1536, 576), (576, 1536)]
MS = [8, 16, 17, 24, 32, 48, 64, 128]
BITS = [2, 4, 8]


def cpu_ms(f, min_time=0.4):
    f()
    f()
    ts, end = [], time.process_time() + min_time
    while time.process_time() < end or len(ts) < 3:
        t0 = time.process_time()
        f()
        ts.append(time.process_time() - t0)
    return float(np.median(ts)) * 1e3


def main():
    _ext.set_max_threads(1)
    _ext.set_repacked_gemm_min_m(1)
    if _ext.repacked_gemm_min_m(0) != 1:
        raise SystemExit("this CPU has no repacked int8 GEMM (AVX512-VNNI)")
    rng = np.random.default_rng(0)
    rows = []
    try:
        for n, k in SHAPES:
            for bits in BITS:
                w = mx.array(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k))
                rt = ops.repack(mixbits.quantize(w.astype(mx.float16), [(bits, 64, k)]))
                mx.eval(rt.arrays())
                for m in MS:
                    x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
                    run = lambda: mx.eval(mixbits.qmatmul(x, rt, activations="int8-all"))  # noqa: E731
                    _ext.set_repacked_gemm_min_m(1)
                    gemm = cpu_ms(run)
                    _ext.set_repacked_gemm_min_m(0)
                    passes = cpu_ms(run)
                    rows.append(dict(n=n, k=k, bits=bits, m=m, gemm_ms=gemm, passes_ms=passes,
                                     passes_over_gemm=passes / gemm))
                    print(f"{n}x{k} {bits}-bit M={m}: GEMM {gemm:.3f} ms, passes {passes:.3f} ms, "
                          f"passes/GEMM {passes / gemm:.2f}", flush=True)
    finally:
        _ext.set_repacked_gemm_min_m(-1)
    r = np.array([row["passes_over_gemm"] for row in rows])
    summary = dict(median=float(np.median(r)), min=float(r.min()), max=float(r.max()),
                   gemm_faster_by_5pct=int((r > 1.05).sum()), cells=len(rows))
    print("passes/GEMM:", summary)
    out = Path(__file__).parent / "results" / "int8_gemm_crossover_1thread_cpu.json"
    out.write_text(json.dumps(dict(rows=rows, summary=summary,
                                   load_average=list(__import__("os").getloadavg())), indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
