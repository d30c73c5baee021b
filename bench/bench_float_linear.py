"""Float layers on the CPU (mixbits.float_linear, issue 40 item 1) against
their baselines, in one run: GFLOP/s of float_matmul (auto path) vs numpy's
float32 sgemm (OpenBLAS, the same shapes) and vs MLX's matmul; GB/s of
weight read at M = 1 vs the read-bandwidth probe; and the reference pass
of a random-weight Llama-shaped float16 model (JointEvaluator's forward over
2 x 128 tokens) with and without mixbits.patch routing.

One thread by default (this is a shared 2-core host): mixbits' cap, and
OpenBLAS's own count set to the same (numpy's sgemm runs on it;
float_matmul calls OpenBLAS single-threaded on its own blocks). Wall time,
best of the repetitions (the least disturbed by other processes).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_float_linear.py [--quick] [--threads 1]

Writes bench/results/float_linear.json.
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

from mixbits import _ext, float_linear
from mixbits.atomic import write_json_atomic

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# (N, K): the float16 model's q/o, gate/up and down projections, a 4096 square.
SHAPES = [(1024, 1024), (2816, 1024), (1024, 2816), (4096, 4096)]
MS = [1, 2, 8, 16, 32, 64, 256]


def cpu_info() -> dict:
    model, flags = platform.processor() or platform.machine(), []
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile")
                         if f in have]
                break
    except OSError:
        pass
    return {"cpu": model, "flags": flags, "cores": os.cpu_count(), "load_avg": list(os.getloadavg())}


def best_time(fn, min_time=0.3, max_reps=50, min_reps=3) -> float:
    fn()
    ts = []
    start = time.perf_counter()
    while len(ts) < max_reps and (len(ts) < min_reps or time.perf_counter() - start < min_time):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def best_times(fns: dict, min_time=1.0, max_reps=200) -> dict:
    """Per fn: the best wall time and the median process CPU time of its
    calls, the calls of all fns interleaved (one of each in turn) so a burst
    of load from other processes hits them alike. On a shared host the CPU
    time is the steadier figure (a preempted call is not charged for the
    wait); both are reported. Every timed call runs on one thread (mixbits'
    cap and OpenBLAS's own count), so CPU time is that thread's time."""
    for fn in fns.values():
        fn()
    wall = {k: float("inf") for k in fns}
    cpu = {k: [] for k in fns}
    start, reps = time.perf_counter(), 0
    while reps < max_reps and (reps < 5 or time.perf_counter() - start < min_time):
        for k, fn in fns.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall[k] = min(wall[k], time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
        reps += 1
    return {k: (wall[k], sorted(cpu[k])[len(cpu[k]) // 2]) for k in fns}


def gemm_rows(shapes, ms, dtypes, mlx_max_flops: float, min_time: float = 1.0) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for n, k in shapes:
        w32 = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        wT = w32.T  # numpy's x @ W.T: sgemm with the transpose flag, no copy
        for dname, dt in dtypes.items():
            w = mx.array(w32).astype(dt)
            mx.eval(w)
            for m in ms:
                x32 = rng.standard_normal((m, k)).astype(np.float32)
                x = mx.array(x32).astype(dt)
                mx.eval(x)
                flops = 2.0 * m * n * k
                t = best_times({"ours": lambda: mx.eval(float_linear.float_matmul(x, w)),
                                "numpy": lambda: x32 @ wT}, min_time=min_time)
                (ours, ours_cpu), (numpy_s, numpy_cpu) = t["ours"], t["numpy"]
                row = {"n": n, "k": k, "m": m, "dtype": dname,
                       "path": "gemv" if m <= _ext.float_matmul_gemv_max_rows(dt != mx.float32) else "blas",
                       "ours_ms": ours * 1e3, "numpy_sgemm_ms": numpy_s * 1e3,
                       "ours_cpu_ms": ours_cpu * 1e3, "numpy_cpu_ms": numpy_cpu * 1e3,
                       "ours_gflops": flops / ours / 1e9, "numpy_gflops": flops / numpy_s / 1e9,
                       "ours_vs_numpy": numpy_s / ours, "ours_vs_numpy_cpu": numpy_cpu / ours_cpu}
                if flops <= mlx_max_flops:  # MLX's reference BLAS: seconds per call beyond this
                    mlx_s = best_time(lambda: mx.eval(x @ w.T), min_time=0.0, max_reps=2, min_reps=1)
                    row.update(mlx_ms=mlx_s * 1e3, mlx_gflops=flops / mlx_s / 1e9, ours_vs_mlx=mlx_s / ours)
                rows.append(row)
                print(f"{n:>5}x{k:<5} {dname:>8} M={m:<4} ours {row['ours_gflops']:7.1f} GFLOP/s "
                      f"({row['path']}), numpy sgemm {row['numpy_gflops']:7.1f} ({row['ours_vs_numpy']:.2f}x wall, "
                      f"{row['ours_vs_numpy_cpu']:.2f}x CPU)"
                      + (f", MLX {row['mlx_gflops']:6.2f} ({row['ours_vs_mlx']:.0f}x)" if "mlx_ms" in row else "")
                      , flush=True)
    return rows


def cold_m1_rows(n: int, k: int, dtypes, pool_bytes: int) -> list[dict]:
    """GB/s of weight read at M = 1 from DRAM: calls cycle through copies
    of the weight totalling pool_bytes (past the last-level cache, as the
    probe's buffer is), one evaluated call each, as a decode step runs."""
    rows = []
    for dname, dt in dtypes.items():
        nbytes = n * k * (4 if dt == mx.float32 else 2)
        ws = []
        for i in range(max(2, pool_bytes // nbytes)):
            ws.append((mx.random.normal((n, k), key=mx.random.key(i)) / k**0.5).astype(dt))
            mx.eval(ws[-1])
        x = mx.random.normal((1, k)).astype(dt)
        mx.eval(x)

        def sweep():
            for w in ws:
                mx.eval(float_linear.float_matmul(x, w))

        # The probe in turn with the kernel (best of each): the host's load
        # moves both alike.
        s, probe = float("inf"), 0.0
        for _ in range(4):
            probe = max(probe, float(_ext.read_bandwidth_gbps(1 << 30, 2)))
            s = min(s, best_time(sweep, min_time=0.0, max_reps=2, min_reps=2) / len(ws))
        rows.append({"n": n, "k": k, "m": 1, "dtype": dname, "copies": len(ws), "ms": s * 1e3,
                     "gbps": nbytes / s / 1e9, "probe_gbps": probe, "vs_probe": nbytes / s / 1e9 / probe})
        del ws
    return rows


# Llama shapes of the reference pass; 1b is a 1.03B-parameter TinyLlama-like model (2048 wide, 20 layers).
MODELS = {"156m": dict(hidden=1024, layers=8, inter=2816, vocab=32000),
          "1b": dict(hidden=2048, layers=20, inter=5632, vocab=32000)}


def llama_float16(hidden: int, layers: int, inter: int, vocab: int, seed: int = 0):
    """A random-weight Llama (mlx-lm's class) in float16, untied head."""
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=inter, num_attention_heads=hidden // 64,
                           num_key_value_heads=max(1, hidden // 256), rms_norm_eps=1e-5,
                           vocab_size=vocab, tie_word_embeddings=False)
    mx.random.seed(seed)
    model = llama.Model(args)
    model.update(tree_map(lambda p: p.astype(mx.float16), model.parameters()))
    mx.eval(model.parameters())
    model.eval()
    nparams = sum(v.size for _, v in tree_flatten(model.parameters()))
    return model, nparams


def reference_pass(model, tokens, routed: bool) -> float:
    from mixbits.measure.joint import JointEvaluator
    from mixbits.routing import patch_functions, unpatch_functions

    taken = patch_functions(model) if routed else []
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        JointEvaluator(model, tokens, chunk=4)
        return time.perf_counter() - t0, time.process_time() - c0, taken
    finally:
        if routed:
            unpatch_functions(model)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="two shapes, float16 only")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--model-only", action="store_true", help="only the reference pass (e.g. with --threads 2)")
    ap.add_argument("--model-size", choices=sorted(MODELS), default="156m",
                    help="the float16 Llama whose reference pass is timed (1b: TinyLlama-like, issue 40's 1B case)")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds per GEMM case (interleaved)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "float_linear.json"))
    a = ap.parse_args(argv)
    mx.set_default_device(mx.cpu)
    _ext.set_max_threads(a.threads)
    lib = float_linear.blas_library()
    _ext.set_blas_threads(a.threads)  # numpy's sgemm on as many threads as ours
    # One call first: float_matmul sets OpenBLAS's threads (numpy's too).
    mx.eval(float_linear.float_matmul(mx.ones((8, 8)), mx.ones((8, 8))))
    info = cpu_info() | {"threads": _ext.max_threads(), "blas": lib, "blas_symbol": _ext.blas_description(),
                         "gemv_backends": float_linear.available_backends(),
                         "gemv_max_rows": {"float32": _ext.float_matmul_gemv_max_rows(False),
                                           "half": _ext.float_matmul_gemv_max_rows(True)},
                         "blas_threads": _ext.blas_threads(),
                         "env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE",
                                                                "MIXBITS_NUM_THREADS", "MIXBITS_ISA")}}
    probe = float(_ext.read_bandwidth_gbps(1 << 30, 5))
    info["probe_gbps"] = probe
    print(json.dumps(info, indent=1))
    print(f"read-bandwidth probe ({a.threads} thread(s)): {probe:.1f} GB/s")
    shapes = SHAPES[:2] if a.quick else SHAPES
    dtypes = {"float16": mx.float16} if a.quick else DTYPES
    rows = [] if a.model_only else gemm_rows(shapes, MS, dtypes, mlx_max_flops=2.0 * 64 * 1024 * 2816,
                                             min_time=a.min_time)
    cold = [] if a.model_only else cold_m1_rows(4096, 4096, dtypes, pool_bytes=1 << 30)
    for r in cold:
        print(f"M=1 from DRAM, 4096x4096 {r['dtype']:>8}: {r['gbps']:.1f} GB/s = {100 * r['vs_probe']:.0f}% "
              f"of the probe's {r['probe_gbps']:.1f} GB/s, measured in turn ({r['copies']} copies cycled)",
              flush=True)
    result = {"meta": info, "rows": rows, "m1_dram": cold}
    if not a.no_model:
        cfg = MODELS[a.model_size]
        model, nparams = llama_float16(**cfg)
        tokens = np.random.default_rng(1).integers(0, cfg["vocab"], size=(2, 128))
        reference_pass(model, tokens[:, :16], routed=True)  # first-call costs (BLAS threads, buffers)
        after, after_cpu, taken = reference_pass(model, tokens, routed=True)
        before, before_cpu, _ = reference_pass(model, tokens, routed=False)
        result["model"] = cfg | {"dtype": "float16", "params": nparams, "tokens": [2, 128],
                                 "routed": taken, "before_s": before, "after_s": after,
                                 "before_cpu_s": before_cpu, "after_cpu_s": after_cpu,
                                 "speedup": before / after, "speedup_cpu": before_cpu / after_cpu}
        print(f"float16 Llama {cfg} ({nparams / 1e6:.0f}M params), JointEvaluator reference pass "
              f"over 2 x 128 tokens: MLX {before:.1f} s, mixbits.patch {after:.2f} s ({before / after:.0f}x); "
              f"CPU time {before_cpu:.1f} s vs {after_cpu:.2f} s ({before_cpu / after_cpu:.0f}x)")
    out = Path(a.out)
    write_json_atomic(result, out, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
