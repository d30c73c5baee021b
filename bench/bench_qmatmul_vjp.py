"""The gradient of mixbits.qmatmul wrt x on the CPU, one thread, CPU time:
the transposed kernel through the packed weights (what mx.vjp now runs on a
CPU stream) against the path it replaced (mx.dequantize + mx.matmul, MLX's
reference-BLAS CPU matmul on Linux) and numpy float32 dy @ W (OpenBLAS
sgemm on a W dequantized beforehand, so numpy pays no decode). On an
AVX-512 CPU the "avx2-only" column forces the 8-lane kernel
(backend="avx2"), what an AVX2-only CPU runs.

SmolLM2-135M shapes N x K = 1536x576, 576x1536, 576x576, 192x576,
49152x576 at M = 256 and 1024; 4-bit g64, 8-bit g64, and a mixed tensor
(6/4/3-bit g64 on 1/4, 1/2, 1/4 of the columns, with a permutation).
Writes bench/results/qmatmul_vjp_1thread_cpu.json and prints the table.

--gather times the gathered product's gradient wrt x instead (MoE experts,
mixbits.gather_qmatmul): E=8 experts of 1536x576 and 576x1536, 128 tokens
routed top-2 (256 pairs of M=1 rows), the transposed kernel through the
packed stack against the path it replaced (every expert dequantized, MLX's
gather_mm, scatter-add back to x) and numpy/OpenBLAS (experts dequantized
once outside the timing, one sgemm per expert), alternating per repeat (on
a loaded machine both see the same load). Writes
bench/results/gather_vjp_1thread_cpu.json.

    OPENBLAS_NUM_THREADS=1 python bench/bench_qmatmul_vjp.py [--quick | --gather]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mixbits
from mixbits import _ext
from mixbits.layout import QuantizedTensor, Segment

SHAPES = [(1536, 576), (576, 1536), (576, 576), (192, 576), (49152, 576)]
MS = [256, 1024]
KINDS = ["4b_g64", "8b_g64", "mixed_6-4-3_g64"]


def cpu_flags() -> list[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                want = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"]
                return [f for f in want if f in have]
    except OSError:
        pass
    return [platform.machine()]


def segments(kind: str, k: int):
    if kind == "4b_g64":
        return [(4, 64, k)], False
    if kind == "8b_g64":
        return [(8, 64, k)], False
    q = k // 64 // 4 * 64
    return [(6, 64, q), (4, 64, k - 2 * q), (3, 64, q)], True


def time_call(fn, min_time: float, max_reps: int = 50) -> dict:
    """Median CPU time over repetitions after a warm-up; a call slower than
    2 s is timed once (its warm-up is the sample)."""
    t0 = time.process_time()
    fn()
    first = time.process_time() - t0
    ts = []
    if first > 2.0:
        ts = [first]
    else:
        start = time.perf_counter()
        while len(ts) < max_reps and (len(ts) < 3 or time.perf_counter() - start < min_time):
            t0 = time.process_time()
            fn()
            ts.append(time.process_time() - t0)
    return {"median_s": statistics.median(ts), "min_s": min(ts), "reps": len(ts)}


def case(n, k, kind, m, rng, min_time, wide):
    segs, use_perm = segments(kind, k)
    w = mx.array(rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k))
    perm = rng.permutation(k).astype(np.int32) if use_perm else None
    qt = mixbits.quantize(w, segs, perm=perm)
    x = mx.array(rng.standard_normal((m, k), dtype=np.float32))
    dy = mx.array(rng.standard_normal((m, n), dtype=np.float32))
    mx.eval(x, dy, *qt.arrays())

    def new(backend=None):  # only dx is evaluated: the forward is not in its graph
        _, (dx,) = mx.vjp(lambda v: mixbits.qmatmul(v, qt, backend=backend), [x], [dy])
        mx.eval(dx)

    def avx2_only():
        new("avx2")

    def old():  # what MixedQMatmul's vjp built before: dequantize, matmul, scatter
        W = mx.concatenate([mx.dequantize(s.wq, s.scales, s.biases, group_size=s.group_size,
                                          bits=s.bits) for s in qt.segments], axis=-1)
        dxp = dy @ W
        if qt.perm is not None:
            dxp = mx.zeros_like(dxp).at[:, qt.perm].add(dxp)
        mx.eval(dxp)

    W = np.array(qt.dequantize(unpermute=True), dtype=np.float32)
    dyn = np.array(dy)

    def numpy():
        dyn @ W

    t = {"mixbits": time_call(new, min_time)}
    if wide:
        t["mixbits_avx2_only"] = time_call(avx2_only, min_time)
    t.update({"mlx_old": time_call(old, min_time, 3), "numpy": time_call(numpy, min_time)})
    ms = {k_: v["median_s"] * 1e3 for k_, v in t.items()}
    flop = 2.0 * m * n * k
    return {"n": n, "k": k, "kind": kind, "m": m, "times": t, "ms": ms,
            "gflops": {k_: flop / v / 1e6 for k_, v in ms.items()},
            "old_over_new": ms["mlx_old"] / ms["mixbits"], "numpy_over_new": ms["numpy"] / ms["mixbits"]}


GATHER_SHAPES = [(1536, 576), (576, 1536)]


def gather_case(n, k, kind, rng, reps, experts=8, tokens=128, top_k=2):
    segs, use_perm = segments(kind, k)
    w = mx.array(rng.standard_normal((experts * n, k), dtype=np.float32) / np.sqrt(k))
    qt = mixbits.quantize(w, segs, perm=rng.permutation(k).astype(np.int32) if use_perm else None)
    qt = QuantizedTensor(
        [Segment(s.bits, s.group_size, s.k, *(a.reshape(experts, n, -1) for a in (s.wq, s.scales, s.biases)))
         for s in qt.segments], qt.perm)
    x = mx.array(rng.standard_normal((tokens, 1, 1, k), dtype=np.float32))
    rhs = mx.array(rng.integers(0, experts, (tokens, top_k)).astype(np.uint32))
    dy = mx.array(rng.standard_normal((tokens, top_k, 1, n), dtype=np.float32))
    lhs = mx.broadcast_to(mx.arange(tokens)[:, None], rhs.shape).reshape(-1)
    mx.eval(x, rhs, dy, lhs, *qt.arrays())

    def new():  # what mx.vjp of gather_qmatmul runs on a CPU stream now
        _, (dx,) = mx.vjp(lambda v: mixbits.gather_qmatmul(v, qt, rhs_indices=rhs), [x], [dy])
        mx.eval(dx)
        return dx

    def old():  # what MixedGatherQMM's vjp built before, in the same MLX ops
        W = mx.concatenate([mx.dequantize(s.wq, s.scales, s.biases, group_size=s.group_size,
                                          bits=s.bits) for s in qt.segments], axis=-1)
        g = mx.gather_mm(dy, W.astype(mx.float32), None, rhs)
        if qt.perm is not None:
            g = mx.zeros_like(g).at[..., qt.perm].add(g)
        dx = mx.zeros((tokens, 1, k)).at[lhs].add(g.reshape(-1, 1, k))
        dx = dx.reshape(x.shape)
        mx.eval(dx)
        return dx

    # numpy/OpenBLAS: the experts dequantized once outside the timing (a
    # float copy of every expert, E*N*K*4 bytes), each expert's routed rows
    # one sgemm, then the scatter-add into x's rows.
    Wn = np.array(mx.concatenate([mx.dequantize(s.wq, s.scales, s.biases, group_size=s.group_size,
                                                bits=s.bits) for s in qt.segments], axis=-1).astype(mx.float32))
    dyn, rn, ln = np.array(dy).reshape(-1, n), np.array(rhs).reshape(-1), np.array(lhs)
    inv = None if qt.perm is None else np.argsort(np.array(qt.perm))

    def numpy_():
        dx = np.zeros((tokens, k), np.float32)
        for e in range(experts):
            rows = np.nonzero(rn == e)[0]
            g = dyn[rows] @ Wn[e]
            np.add.at(dx, ln[rows], g if inv is None else g[:, inv])
        return dx.reshape(x.shape)

    a, b = np.array(new()), np.array(old())  # warm-up, and the same dx
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max(), "old and new dx differ"
    assert np.abs(numpy_() - b).max() <= 1e-4 * np.abs(b).max(), "numpy and MLX dx differ"
    t = {"old": [], "new": [], "numpy": []}
    for _ in range(reps):
        for name, fn in (("old", old), ("new", new), ("numpy", numpy_)):
            t0 = time.process_time()
            fn()
            t[name].append(time.process_time() - t0)
    ms = {k_: statistics.median(v) * 1e3 for k_, v in t.items()}
    return {"experts": experts, "n": n, "k": k, "kind": kind, "pairs": tokens * top_k, "m": 1,
            "reps": reps, "ms": ms, "min_ms": {k_: min(v) * 1e3 for k_, v in t.items()},
            "old_over_new": ms["old"] / ms["new"], "numpy_over_new": ms["numpy"] / ms["new"]}


def gather_main(out: str, reps: int):
    print("gather_qmatmul vjp wrt x: one thread, CPU time (median of alternating repeats)")
    hdr = (f"{'E x N x K':>13} {'kind':>16} {'pairs':>5} {'old ms':>9} {'new ms':>8} {'numpy ms':>8} "
           f"{'old/new':>7} {'numpy/new':>9}")
    print(hdr + "\n" + "-" * len(hdr))
    rng = np.random.default_rng(0)
    rows = []
    for n, k in GATHER_SHAPES:
        for kind in ("4b_g64", "mixed_6-4-3_g64"):
            r = gather_case(n, k, kind, rng, reps)
            rows.append(r)
            print(f"{f'8x{n}x{k}':>13} {kind:>16} {r['pairs']:>5} {r['ms']['old']:>9.1f} "
                  f"{r['ms']['new']:>8.2f} {r['ms']['numpy']:>8.2f} {r['old_over_new']:>7.1f} "
                  f"{r['numpy_over_new']:>9.2f}", flush=True)
    res = {"cpu_flags": cpu_flags(), "clock": "process_time, median, old/new/numpy alternating", "threads": 1,
           "load_average": os.getloadavg(), "mlx": mx.__version__, "rows": rows}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="576x1536 and M=256 only")
    ap.add_argument("--min-time", type=float, default=0.5)
    ap.add_argument("--gather", action="store_true", help="the gathered (MoE) product's gradient instead")
    ap.add_argument("--reps", type=int, default=7, help="--gather: alternating repeats")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    mx.set_default_device(mx.cpu)
    _ext.set_max_threads(1)
    results = Path(__file__).parent / "results"
    if a.gather:
        return gather_main(a.out or str(results / "gather_vjp_1thread_cpu.json"), a.reps)
    a.out = a.out or str(results / "qmatmul_vjp_1thread_cpu.json")
    flags = cpu_flags()
    wide = "avx512" in mixbits.ops.available_backends()
    print(f"CPU flags: {' '.join(flags)}; OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}")
    print("one thread, CPU time (median); dx = dy @ W, GFLOP/s = 2*M*N*K / time")
    hdr = (f"{'N x K':>11} {'kind':>16} {'M':>5} {'mixbits ms':>10} {'avx2-only':>9} {'old ms':>9} {'numpy ms':>9} "
           f"{'old/new':>7} {'np/new':>6} {'GFLOP/s':>7}")
    print(hdr + "\n" + "-" * len(hdr))
    rng = np.random.default_rng(0)
    rows = []
    for n, k in ([(576, 1536)] if a.quick else SHAPES):
        for kind in KINDS:
            for m in ([256] if a.quick else MS):
                r = case(n, k, kind, m, rng, a.min_time, wide)
                rows.append(r)
                ms = r["ms"]
                a2 = f"{ms['mixbits_avx2_only']:.2f}" if wide else "-"
                print(f"{f'{n}x{k}':>11} {kind:>16} {m:>5} {ms['mixbits']:>10.2f} {a2:>9} {ms['mlx_old']:>9.1f} "
                      f"{ms['numpy']:>9.2f} {r['old_over_new']:>7.1f} {r['numpy_over_new']:>6.2f} "
                      f"{r['gflops']['mixbits']:>7.1f}", flush=True)
    out = {"cpu_flags": flags, "clock": "process_time, median", "threads": 1,
           "kernel": "16-lane broadcast (AVX-512F)" if wide else "8-lane transposed tiles (AVX2)",
           "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
           "load_average": os.getloadavg(), "mlx": mx.__version__, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
