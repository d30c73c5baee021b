"""The arm64 attention and SwiGLU kernels (cpp/attn/neon.cpp,
cpp/act/neon.cpp), built for aarch64 and run under qemu-user through what
an aarch64 build's nodes run (tests/neon/attn_harness.cpp: the attention
driver, attn/driver.cpp, with select_attn(neon)'s kernels; SwiGLU through
select_swiglu(neon)), on buffers made by MLX here: decode steps read the
first kv_len rows of a cache buffer whose other rows are NaN. Checked
against float64 numpy (reference.py), MLX's own sdpa and its vjp, and
half precision bit for bit against the float32 computation on the
widened inputs. qemu checks results, not speed.

Planted bugs (each reverted), tests of this file failing out of 8: a
later key chunk not added to the first 4; bfloat16 widened by a 15-bit
shift 2; two keys' score lanes swapped 4; the exp row's NaN flag dropped
1; a 32-column tile's last store dropped 5; the head dim's k % 4 tail
dropped from decode scores 3; the 4-row score block run as 3 rows 4;
SwiGLU's g < -88 cut dropped 1; its vjp's silu' missing a factor s 2."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from neon_emulator import ATTN_SOURCES, build, run_attn
from reference import attention64, attention_vjp64, swiglu_vjp64

HALF_EPS = {mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}  # unit roundoff


def rand(rng, shape, dtype=mx.float32):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def cache_buffer(rng, B, Hk, S, cap, D, dtype):
    """A [B, Hk, cap, D] buffer whose first S rows per head are random keys
    and the rest NaN: a read past kv_len shows in the output."""
    x = rng.standard_normal((B, Hk, cap, D)).astype(np.float32)
    x[:, :, S:] = np.nan
    return mx.array(x).astype(dtype)


# B, H, Hk, T, S, D: prompts and decode steps; query rows per KV head from
# 1 to 8 (score blocks of 4 rows and 3/2/1-row tails, P V tiles of 6 rows
# and 5..1-row tails, 32-column tiles at 1-2 rows); keys past the 64-key
# chunks; head dims with 4-lane and scalar tails.
SHAPES = [
    (1, 1, 1, 1, 1, 1),
    (1, 2, 1, 1, 9, 8),
    (2, 9, 3, 37, 37, 64),
    (1, 4, 4, 33, 50, 16),
    (3, 6, 2, 70, 70, 24),
    (1, 8, 2, 64, 64, 128),
    (2, 3, 1, 5, 17, 7),
    (1, 9, 3, 1, 163, 64),
    (2, 6, 2, 1, 30, 22),
    (1, 4, 1, 1, 3, 5),
    (1, 8, 1, 1, 300, 64),
    (2, 10, 2, 1, 517, 40),
    (1, 7, 7, 1, 200, 12),
    (1, 16, 8, 1, 130, 128),
    (1, 8, 2, 1, 70, 36),
    (1, 4, 2, 150, 150, 24),
]
# Decode steps on a cache buffer's prefix: B, H, Hk, S (kv_len), capacity, D.
PREFIXES = [(1, 9, 3, 100, 256, 64), (2, 6, 2, 65, 128, 21), (1, 16, 8, 300, 512, 128),
            (1, 2, 1, 1, 4, 8)]
# Half precision: B, H, Hk, S, D, each with T = 1, S // 2 and S.
HALF_SHAPES = [(1, 8, 1, 130, 40), (2, 5, 5, 70, 12)]
VJP_SHAPES = [(1, 4, 2, 5, 40, 16), (2, 6, 3, 33, 70, 24), (1, 2, 1, 1, 70, 128),
              (1, 9, 3, 64, 64, 64), (1, 5, 1, 40, 40, 7)]
SWIGLU_SIZES = [1, 7, 8, 255, 256, 257, 5001]


def _cases():
    """Every case the harness runs, with what each test needs to check it."""
    rng = np.random.default_rng(7)
    cases, meta = [], []
    for shape in SHAPES:
        B, H, Hk, T, S, D = shape
        q, k, v = rand(rng, (B, H, T, D)), rand(rng, (B, Hk, S, D)), rand(rng, (B, Hk, S, D))
        scale = float(D) ** -0.5
        cases.append(("attn", q, k, v, S, scale))
        meta.append(("shape", shape, (q, k, v, scale)))
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        for B, H, Hk, S, cap, D in PREFIXES:
            q = rand(rng, (B, H, 1, D), dtype)
            k, v = (cache_buffer(rng, B, Hk, S, cap, D, dtype) for _ in range(2))
            cases.append(("attn", q, k, v, S, 0.3))
            meta.append(("prefix", (dtype, B, H, Hk, S, cap, D), (q, k[:, :, :S], v[:, :, :S], 0.3)))
    for dtype in (mx.float16, mx.bfloat16):
        for B, H, Hk, S, D in HALF_SHAPES:
            for T in (1, S // 2, S):
                q, k, v = rand(rng, (B, H, T, D), dtype), rand(rng, (B, Hk, S, D), dtype), rand(rng, (B, Hk, S, D), dtype)
                wide = [a.astype(mx.float32) for a in (q, k, v)]
                cases.append(("attn", q, k, v, S, 0.2))
                cases.append(("attn", *wide, S, 0.2))
                meta.append(("half", (dtype, B, H, Hk, T, S, D), (q, k, v, 0.2)))
                meta.append(("half_twin", None, None))
    for B, H, Hk, T, S, D in VJP_SHAPES:
        q, k, v, dout = rand(rng, (B, H, T, D)), rand(rng, (B, Hk, S, D)), rand(rng, (B, Hk, S, D)), rand(rng, (B, H, T, D))
        scale = float(rng.choice([D ** -0.5, 0.05, 1.3]))
        cases.append(("attn_vjp", q, k, v, dout, scale))
        meta.append(("vjp", (B, H, Hk, T, S, D), (q, k, v, dout, scale)))
    for shape in ((1, 2, 1, 4, 6, 8), (1, 3, 1, 1, 9, 8)):  # a prompt, a decode step
        B, H, Hk, T, S, D = shape
        qn = rng.standard_normal((B, H, T, D)).astype(np.float32)
        qn[0, 1, T // 2, 3] = np.nan
        q, k, v = mx.array(qn), rand(rng, (B, Hk, S, D)), rand(rng, (B, Hk, S, D))
        cases.append(("attn", q, k, v, S, 0.5))
        meta.append(("nan", shape, (q, k, v, 0.5)))
        # one NaN key (not the first): one NaN score in the rows that see it
        kn = rng.standard_normal((B, Hk, S, D)).astype(np.float32)
        kn[0, 0, 2, 5] = np.nan
        q, k = rand(rng, (B, H, T, D)), mx.array(kn)
        cases.append(("attn", q, k, v, S, 0.5))
        meta.append(("nan", shape, (q, k, v, 0.5)))
    for n in SWIGLU_SIZES:
        g = rng.standard_normal(n).astype(np.float32) * 8
        u, dy = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
        g[:4] = [0.0, -100.0, 100.0, -87.5][: min(4, n)]
        cases += [("swiglu", g, u), ("swiglu_vjp", g, u, dy)]
        meta += [("swiglu", n, (g, u)), ("swiglu_vjp", n, (g, u, dy))]
    # +-inf and NaN against MLX's silu and its gradient
    g = np.array([0.0, -0.0, 1e-30, 5.0, -5.0, 30.0, -30.0, 87.5, -87.5, 88.5, -88.5,
                  100.0, -100.0, 1e30, -1e30, np.inf, -np.inf, np.nan], np.float32)
    u = np.linspace(-2, 3, g.size).astype(np.float32)
    u[3] = np.nan
    dy = np.linspace(1, -1.5, g.size).astype(np.float32)
    cases += [("swiglu", g, u), ("swiglu_vjp", g, u, dy)]
    meta += [("swiglu_extreme", None, (g, u)), ("swiglu_vjp_extreme", None, (g, u, dy))]
    return cases, meta


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """(meta, outputs at 1 thread, outputs at 2 threads) of every case."""
    tmp = tmp_path_factory.mktemp("attn_neon")
    exe = build(tmp / "attn_harness", ATTN_SOURCES)
    cases, meta = _cases()
    return meta, run_attn(exe, tmp, cases), run_attn(exe, tmp, cases, threads=2)


def _of(results, kind):
    meta, one, two = results
    found = [(m[1], m[2], a, b) for m, a, b in zip(meta, one, two) if m[0] == kind]
    assert found, kind
    return found


def test_attention_matches_float64_and_mlx(results):
    for shape, (q, k, v, scale), (got,), _ in _of(results, "shape"):
        want = attention64(q, k, v, scale)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4, err_msg=str(shape))
        mlx = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
        np.testing.assert_allclose(got, np.array(mlx), atol=2e-5, rtol=1e-4, err_msg=str(shape))


def test_decode_reads_only_the_prefix_of_a_cache_buffer(results):
    """One query over the first kv_len rows of [B, Hk, capacity, D]
    buffers whose later rows are NaN, in each dtype."""
    for what, (q, k, v, scale), (got,), _ in _of(results, "prefix"):
        dtype = what[0]
        assert np.isfinite(got).all(), what
        want = attention64(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), scale)
        rtol = 1e-4 if dtype == mx.float32 else HALF_EPS[dtype] + 1e-5
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=rtol, err_msg=str(what))


def test_half_precision_is_the_float32_computation(results):
    """float16 / bfloat16 K and V read as they are: the output is bit for
    bit the float32 computation on the widened inputs, rounded once."""
    meta, one, _ = results
    n = 0
    for i, m in enumerate(meta):
        if m[0] != "half":
            continue
        dtype = m[1][0]
        assert meta[i + 1][0] == "half_twin"
        rounded = np.array(mx.array(one[i + 1][0].astype(np.float32)).astype(dtype).astype(mx.float32))
        np.testing.assert_array_equal(one[i][0], rounded, err_msg=str(m[1]))
        q, k, v, scale = m[2]
        want = attention64(*(a.astype(mx.float32) for a in (q, k, v)), scale)
        np.testing.assert_allclose(one[i][0], want, atol=1e-5, rtol=HALF_EPS[dtype] + 1e-5)
        n += 1
    assert n == 2 * len(HALF_SHAPES) * 3


def test_attention_vjp_matches_float64_and_mlx(results):
    for shape, (q, k, v, dout, scale), got, _ in _of(results, "vjp"):
        want64 = attention_vjp64(q, k, v, dout, scale)
        _, want_mlx = mx.vjp(lambda q, k, v: [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")],
                             [q, k, v], [dout])
        for name, g, w64, wm in zip("qkv", got, want64, want_mlx):
            tol = 3e-5 * max(1.0, np.abs(w64).max())
            np.testing.assert_allclose(g, w64, rtol=0, atol=tol, err_msg=f"d{name} {shape}")
            np.testing.assert_allclose(g, np.array(wm), rtol=0, atol=tol, err_msg=f"d{name} {shape}")


def test_results_do_not_depend_on_the_thread_count(results):
    meta, one, two = results
    for m, a, b in zip(meta, one, two):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y, err_msg=str(m[:2]))


def test_swiglu_matches_float64(results):
    for n, (g, u), (got,), _ in _of(results, "swiglu"):
        g64, u64 = g.astype(np.float64), u.astype(np.float64)
        np.testing.assert_allclose(got, g64 * u64 / (1 + np.exp(-g64)), rtol=3e-6, atol=1e-30, err_msg=str(n))
    for n, (g, u, dy), got, _ in _of(results, "swiglu_vjp"):
        for x, w in zip(got, swiglu_vjp64(g, u, dy)):
            np.testing.assert_allclose(x, w, rtol=2e-6, atol=1e-6, err_msg=str(n))


def test_swiglu_extremes_match_mlx(results):
    """Large |g| (the exp's clamp), +-inf and NaN: NaN exactly where MLX's
    silu and its gradient give NaN, equal elsewhere."""
    (_, (g, u), (got,), _), = _of(results, "swiglu_extreme")
    want = np.array(nn.silu(mx.array(g)) * mx.array(u))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-5, atol=1e-30)
    (_, (g, u, dy), got, _), = _of(results, "swiglu_vjp_extreme")
    want = mx.vjp(lambda g, u: [nn.silu(g) * u], [mx.array(g), mx.array(u)], [mx.array(dy)])[1]
    for x, w in zip(got, want):
        w = np.array(w)
        np.testing.assert_array_equal(np.isnan(x), np.isnan(w))
        ok = ~np.isnan(w)
        np.testing.assert_allclose(x[ok], w[ok], rtol=1e-5, atol=1e-30)


def test_nan_scores_give_nan_rows(results):
    """NEON's vector exp maps NaN to 0; a NaN query or key must still give
    NaN rows where MLX's sdpa does (as the x86 kernels do), not a softmax
    that skips the NaN score."""
    for shape, (q, k, v, scale), (got,), _ in _of(results, "nan"):
        want = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal"))
        assert np.isnan(want).any()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=str(shape))
        ok = ~np.isnan(want)
        np.testing.assert_allclose(got[ok], want[ok], atol=2e-5, rtol=1e-4)
