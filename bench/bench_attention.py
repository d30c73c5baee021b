"""Causal GQA attention and fused SwiGLU under pytest-benchmark, with
baselines and bounds from the same run:

- attention: ``mlx`` = mx.fast.scaled_dot_product_attention(mask="causal")
  (MLX's CPU path), ``numpy`` = the same in float32 numpy/OpenBLAS (GQA by
  reshaping, full score matrix); bound = the causal FLOPs (both GEMMs, the
  lower triangle only) at the rate OpenBLAS sgemm reaches in this run on a
  1024^3 product (a compute roofline the machine demonstrably achieves);
- SwiGLU: ``mlx`` = nn.silu(g) * u, ``numpy`` = g * u / (1 + exp(-g)) in
  float32; bound = bytes moved (read g, u; write y) / the bandwidth probe.

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64;
intermediate 1536) at the batch x length of a sweep chunk.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m pytest bench/bench_attention.py

Tables: bench/results/attention.json and bench/results/swiglu.json.
"""

from __future__ import annotations

import functools
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mixbits.activations import swiglu
from mixbits.attention import causal_attention

H, HK, D, FF = 9, 3, 64, 1536
ATTN_CASES = [(8, 256), (4, 512), (2, 1024), (1, 2048)]
ACT_CASES = [(2048, FF), (256, FF), (8192, FF)]
IMPLS = ["mixbits", "mlx", "numpy"]


@functools.lru_cache(maxsize=1)
def _sgemm_flops() -> float:
    """Best FLOP/s of a 1024^3 float32 numpy (OpenBLAS) matmul, all threads."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((1024, 1024), dtype=np.float32)
    b = rng.standard_normal((1024, 1024), dtype=np.float32)
    a @ b
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * 1024**3 / best


@functools.lru_cache(maxsize=2)
def _qkv(B: int, T: int):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    k = rng.standard_normal((B, HK, T, D), dtype=np.float32)
    v = rng.standard_normal((B, HK, T, D), dtype=np.float32)
    Q, K, V = mx.array(q), mx.array(k), mx.array(v)
    mx.eval(Q, K, V)
    return q, k, v, Q, K, V


def numpy_attention(q, k, v, scale):
    B, _, T, _ = q.shape
    s = (q * scale).reshape(B, HK, (H // HK) * T, D) @ k.transpose(0, 1, 3, 2)
    s = s.reshape(B, HK, H // HK, T, T)
    s = np.where(np.tril(np.ones((T, T), bool)), s, np.float32(-np.inf))
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    return (s.reshape(B, HK, -1, T) @ v).reshape(B, H, T, D)


def _attn_runner(impl, B, T):
    q, k, v, Q, K, V = _qkv(B, T)
    if impl == "mixbits":
        return lambda: mx.eval(causal_attention(Q, K, V, D**-0.5))
    if impl == "mlx":
        return lambda: mx.eval(mx.fast.scaled_dot_product_attention(Q, K, V, scale=D**-0.5, mask="causal"))
    return lambda: numpy_attention(q, k, v, np.float32(D**-0.5))


def _attn_format(rows, meta):
    out = [f"sgemm rate (numpy/OpenBLAS, 1024^3, this run): {meta['sgemm_gflops']:.1f} GFLOP/s",
           f"{'B x T':<10}{'impl':<9}{'ms':>9}{'x mlx':>8}{'x numpy':>9}{'GFLOP/s':>9}{'% sgemm':>9}"]
    for r in rows:
        base = {x["impl"]: x["best_s"] for x in rows if (x["B"], x["T"]) == (r["B"], r["T"])}
        rat = lambda k: f"{base[k] / r['best_s']:.1f}" if k in base else "-"  # noqa: E731
        out.append(f"{r['B']}x{r['T']:<8}{r['impl']:<9}{1e3 * r['best_s']:9.2f}{rat('mlx'):>8}"
                   f"{rat('numpy'):>9}{r['gflops']:9.1f}{100 * r['gflops'] / meta['sgemm_gflops']:9.0f}")
    out.append("GFLOP/s counts the causal work only (4 B H D T(T+1)/2), for every impl")
    return "\n".join(out)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B,T", ATTN_CASES, ids=[f"{b}x{t}" for b, t in ATTN_CASES])
def test_attention(benchmark, B, T, impl, bench_table):
    table = bench_table("attention", _attn_format)
    table.meta["sgemm_gflops"] = _sgemm_flops() / 1e9
    fn = _attn_runner(impl, B, T)
    slow = impl != "mixbits"
    benchmark.group = f"attention {B}x{T}"
    benchmark.pedantic(fn, rounds=3 if slow else 11, iterations=1, warmup_rounds=1)
    best = benchmark.stats.stats.min
    flops = 4 * B * H * D * T * (T + 1) / 2
    row = {"B": B, "T": T, "impl": impl, "best_s": best, "median_s": benchmark.stats.stats.median,
           "gflops": flops / best / 1e9}
    benchmark.extra_info.update(row)
    table.add(row)


@functools.lru_cache(maxsize=1)
def _gu(M: int, N: int):
    rng = np.random.default_rng(2)
    g = rng.standard_normal((M, N), dtype=np.float32) * 3
    u = rng.standard_normal((M, N), dtype=np.float32)
    G, U = mx.array(g), mx.array(u)
    mx.eval(G, U)
    return g, u, G, U


def _act_runner(impl, M, N):
    g, u, G, U = _gu(M, N)
    if impl == "mixbits":
        return lambda: mx.eval(swiglu(G, U))
    if impl == "mlx":
        return lambda: mx.eval(nn.silu(G) * U)
    return lambda: g * u / (np.float32(1) + np.exp(-g))


def _act_format(rows, meta):
    out = [f"bandwidth probe {meta['probe_gbps']:.1f} GB/s",
           f"{'M x N':<12}{'impl':<9}{'ms':>9}{'x mlx':>8}{'x numpy':>9}{'GB/s':>7}{'% bw':>6}"]
    for r in rows:
        base = {x["impl"]: x["best_s"] for x in rows if (x["M"], x["N"]) == (r["M"], r["N"])}
        rat = lambda k: f"{base[k] / r['best_s']:.1f}" if k in base else "-"  # noqa: E731
        gbps = r["bytes"] / r["best_s"] / 1e9
        out.append(f"{r['M']}x{r['N']:<7}{r['impl']:<9}{1e3 * r['best_s']:9.2f}{rat('mlx'):>8}"
                   f"{rat('numpy'):>9}{gbps:7.1f}{100 * gbps / meta['probe_gbps']:6.0f}")
    out.append("bytes: read gate and up, write y (12 bytes per element)")
    return "\n".join(out)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("M,N", ACT_CASES, ids=[f"{m}x{n}" for m, n in ACT_CASES])
def test_swiglu(benchmark, M, N, impl, probe_gbps, bench_table):
    table = bench_table("swiglu", _act_format)
    table.meta["probe_gbps"] = probe_gbps
    fn = _act_runner(impl, M, N)
    benchmark.group = f"swiglu {M}x{N}"
    benchmark.pedantic(fn, rounds=5 if impl != "mixbits" else 21, iterations=1, warmup_rounds=1)
    best = benchmark.stats.stats.min
    row = {"M": M, "N": N, "impl": impl, "best_s": best, "bytes": 12 * M * N}
    benchmark.extra_info.update(row)
    table.add(row)
