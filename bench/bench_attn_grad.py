"""Causal GQA attention forward + backward (vjp wrt q, k, v) at SmolLM2-135M's
layout (9 query / 3 KV heads, head_dim 64), one thread, CPU time:

- ``mixbits``: mx.vjp through mixbits' causal_attention (CPU kernel forward,
  CausalAttentionVJP backward: cpp/attn/grad.cpp);
- ``mlx``: mx.vjp through mx.fast.scaled_dot_product_attention(mask="causal")
  (MLX's CPU composite and its MLX-op derivative; what a differentiated,
  unrouted forward runs);
- ``numpy``: forward and backward written in float32 numpy (OpenBLAS, one
  thread; GQA by reshaping, full T x T scores).

Also SwiGLU forward + backward at the MLP's shape (intermediate 1536):
mixbits' Swiglu / SwigluVjp against nn.silu(g) * u under mx.vjp and numpy.

    OPENBLAS_NUM_THREADS=1 python bench/bench_attn_grad.py

Table: bench/results/attn_grad.json (median and best of the rounds).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

from mixbits import _ext  # noqa: E402

H, HK, D, FF = 9, 3, 64, 1536
ATTN_CASES = [(1, 256), (4, 256), (1, 1024)]
ACT_CASES = [(256, FF), (1024, FF)]
OUT = Path(__file__).parent / "results" / "attn_grad.json"


def cpu_times(fns: dict, rounds: dict) -> dict:
    """{name: (median, best)} CPU seconds per call. Rounds are interleaved
    (one call of every impl per round, while it has rounds left) so that
    load from other processes on the shared cores hits all impls alike."""
    for fn in fns.values():
        fn()  # warm-up (allocations, lazy init)
    ts = {k: [] for k in fns}
    for i in range(max(rounds.values())):
        for k, fn in fns.items():
            if i < rounds[k]:
                t = time.process_time()
                fn()
                ts[k].append(time.process_time() - t)
    return {k: (float(np.median(v)), float(min(v))) for k, v in ts.items()}


def numpy_attention_fwd_bwd(q, k, v, do, scale):
    """(o, dq, dk, dv) in float32 numpy; the r query heads of a KV group are
    stacked as rows so each group is one GEMM."""
    B, _, T, _ = q.shape
    S, r = k.shape[2], H // HK
    qg, dog = q.reshape(B, HK, r * T, D), do.reshape(B, HK, r * T, D)
    s = ((qg * scale) @ k.transpose(0, 1, 3, 2)).reshape(B, HK, r, T, S)
    s = np.where(np.tril(np.ones((T, S), bool), S - T), s, np.float32(-np.inf))
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    p = p.reshape(B, HK, r * T, S)
    o = (p @ v).reshape(B, H, T, D)
    dv = p.transpose(0, 1, 3, 2) @ dog
    dp = dog @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    dq = (scale * (ds @ k)).reshape(B, H, T, D)
    dk = scale * (ds.transpose(0, 1, 3, 2) @ qg)
    return o, dq, dk, dv


def attention_rows():
    rows = []
    scale = D**-0.5
    for B, T in ATTN_CASES:
        rng = np.random.default_rng(B * 10000 + T)
        q, do = (rng.standard_normal((B, H, T, D), dtype=np.float32) for _ in range(2))
        k, v = (rng.standard_normal((B, HK, T, D), dtype=np.float32) for _ in range(2))
        Q, K, V, DO = (mx.array(a) for a in (q, k, v, do))
        mx.eval(Q, K, V, DO)

        def ours():
            mx.eval(mx.vjp(lambda q, k, v: [_ext.causal_attention(q, k, v, scale, 0)],
                           [Q, K, V], [DO]))

        def mlx():
            f = lambda q, k, v: [mx.fast.scaled_dot_product_attention(  # noqa: E731
                q, k, v, scale=scale, mask="causal")]
            mx.eval(mx.vjp(f, [Q, K, V], [DO]))

        def numpy():
            numpy_attention_fwd_bwd(q, k, v, do, np.float32(scale))

        # The three agree (a bench of wrong code is no bench).
        _, g = mx.vjp(lambda q, k, v: [_ext.causal_attention(q, k, v, scale, 0)], [Q, K, V], [DO])
        ref = numpy_attention_fwd_bwd(q, k, v, do, np.float32(scale))[1:]
        err = max(float(np.abs(np.array(a) - b).max()) for a, b in zip(g, ref))
        assert err < 1e-3, err
        # Causal work of forward (2 GEMMs) + backward (4), lower triangle only.
        flops = 6 * 2 * B * H * D * T * (T + 1) / 2
        rounds = {"mixbits": 9, "mlx": 3 if B * T * T <= 4 * 256 * 256 else 2, "numpy": 9}
        times = cpu_times({"mixbits": ours, "mlx": mlx, "numpy": numpy}, rounds)
        for impl, (med, best) in times.items():
            rows.append({"B": B, "T": T, "impl": impl, "median_s": med, "best_s": best,
                         "rounds": rounds[impl], "gflops": flops / med / 1e9})
            print(f"attention {B}x{T:<5} {impl:<8} {1e3 * med:9.1f} ms  "
                  f"{flops / med / 1e9:6.1f} GFLOP/s", flush=True)
    return rows


def swiglu_rows():
    rows = []
    for M, N in ACT_CASES:
        rng = np.random.default_rng(M)
        g, u, dy = (rng.standard_normal((M, N), dtype=np.float32) for _ in range(3))
        G, U, DY = (mx.array(a) for a in (g, u, dy))
        mx.eval(G, U, DY)

        def ours():
            mx.eval(mx.vjp(lambda g, u: [_ext.swiglu(g, u, 0)], [G, U], [DY]))

        def mlx():
            mx.eval(mx.vjp(lambda g, u: [nn.silu(g) * u], [G, U], [DY]))

        def numpy():
            s = np.float32(1) / (np.float32(1) + np.exp(-g))
            gs = g * s
            gs * u, dy * u * s * (np.float32(1) + g * (np.float32(1) - s)), dy * gs

        times = cpu_times({"mixbits": ours, "mlx": mlx, "numpy": numpy},
                          {"mixbits": 9, "mlx": 9, "numpy": 9})
        for impl, (med, best) in times.items():
            rows.append({"M": M, "N": N, "impl": impl, "median_s": med, "best_s": best, "rounds": 9})
            print(f"swiglu    {M}x{N:<5} {impl:<8} {1e3 * med:9.2f} ms", flush=True)
    return rows


def main():
    mx.set_default_device(mx.cpu)
    _ext.set_max_threads(1)
    t0 = time.time()
    load = os.getloadavg()[0]
    attn = attention_rows()
    act = swiglu_rows()
    meta = {"threads": 1, "clock": "time.process_time (CPU time, MLX's stream thread included)",
            "statistic": "median of rounds after one warm-up; rounds interleaved across impls",
            "layout": {"H": H, "HK": HK, "D": D, "FF": FF},
            "flops": "6 causal GEMMs (fwd 2 + bwd 4): 12 B H D T(T+1)/2 for every impl",
            "mlx": mx.__version__, "numpy": np.__version__, "python": sys.version.split()[0],
            "machine": platform.machine(), "loadavg_start_end": [load, os.getloadavg()[0]],
            "wall_s": time.time() - t0,
            "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS")}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"meta": meta, "attention": attn, "swiglu": act}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
