"""Causal GQA attention and fused SwiGLU kernels against float64 numpy,
every backend; and the per-model routing of mlx-lm models to them."""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mixbits._backends import BACKENDS, names
from mixbits.activations import act_backends, swiglu
from mixbits.attention import attn_backends, causal_attention
from mixbits.routing import _has_vector_kernel, _routes_prompt_attention, patch_functions, unpatch_functions

from reference import attention64
from tiny_model import tiny_llama, tiny_tokens

# The float linears are routed too where float_matmul has a BLAS (Linux).
from mixbits.float_linear import blas_library

_LINEAR = ["linear"] if blas_library() is not None else []


SHAPES = [  # B, H, Hk, T, S, D
    (1, 1, 1, 1, 1, 1),
    (1, 2, 1, 1, 9, 8),        # one query over a cache (decode-like)
    (2, 9, 3, 37, 37, 64),     # SmolLM2 head layout, T not a block multiple
    (1, 4, 4, 33, 50, 16),     # S > T, no grouping
    (3, 6, 2, 70, 70, 24),     # D not a multiple of the 8/16-lane tiles
    (1, 8, 2, 64, 64, 128),
    (2, 3, 1, 5, 17, 7),
    # decode steps (T = 1: scores straight from the key rows, 4 keys at a time)
    (1, 9, 3, 1, 163, 64),     # keys not a multiple of 4
    (2, 6, 2, 1, 30, 20),      # head dim not a multiple of 8
    (1, 4, 1, 1, 3, 5),        # fewer keys than one step of 4
    # keys past two of the AVX2 GEMM's 64-key chunks (prefetched ahead), with
    # 8, 5 and 1 query rows per KV head (blocks of 3, 2 and 1 rows)
    (1, 8, 1, 1, 300, 64),
    (2, 10, 2, 1, 517, 40),    # head dim: two 16-column tiles and an 8-column tail
    (1, 7, 7, 1, 200, 12),     # head dim under one 16-column tile
    (1, 4, 2, 150, 150, 24),   # a prompt whose P V runs over 3 chunks
]


@pytest.mark.parametrize("backend", attn_backends())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attention_matches_float64(backend, shape):
    B, H, Hk, T, S, D = shape
    rng = np.random.default_rng(hash(shape) % 2**32)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32))
               for s in ((B, H, T, D), (B, Hk, S, D), (B, Hk, S, D)))
    scale = 1 / math.sqrt(D)
    got = np.array(causal_attention(q, k, v, scale, backend=backend))
    np.testing.assert_allclose(got, attention64(q, k, v, scale), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", attn_backends())
@pytest.mark.parametrize("shape", [(1, 2, 1, 4, 6, 8), (1, 3, 1, 1, 9, 8), (2, 6, 2, 40, 70, 24)],
                         ids=lambda s: "x".join(map(str, s)))
def test_nan_scores_give_nan_rows(backend, shape):
    """A NaN query or key gives NaN rows exactly where MLX's sdpa does (the
    vector exp maps NaN to 0, which would drop the NaN score from the
    softmax and return a finite row); the rest as MLX's."""
    B, H, Hk, T, S, D = shape
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((B, H, T, D), (B, Hk, S, D), (B, Hk, S, D)))
    for where in ("query", "key"):
        qn, kn = q.copy(), k.copy()
        if where == "query":
            qn[0, 1, T // 2, 3] = np.nan
        else:
            kn[0, 0, S - T // 2 - 1, 5] = np.nan  # not key 0: a row's max stays finite
        args = mx.array(qn), mx.array(kn), mx.array(v)
        want = np.array(mx.fast.scaled_dot_product_attention(*args, scale=0.5, mask="causal"))
        got = np.array(causal_attention(*args, 0.5, backend=backend))
        assert np.isnan(want).any()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=where)
        ok = ~np.isnan(want)
        np.testing.assert_allclose(got[ok], want[ok], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", attn_backends())
def test_attention_peaked_scores_and_strided_inputs(backend):
    """Large logits (softmax near one-hot, exp far from 0) and inputs that are
    transposed views, as mlx-lm passes them."""
    rng = np.random.default_rng(3)
    B, T, H, Hk, D = 2, 45, 6, 3, 32
    q = mx.array(rng.standard_normal((B, T, H, D)).astype(np.float32) * 6).transpose(0, 2, 1, 3)
    k = mx.array(rng.standard_normal((B, T, Hk, D)).astype(np.float32) * 6).transpose(0, 2, 1, 3)
    v = mx.array(rng.standard_normal((B, T, Hk, D)).astype(np.float32)).transpose(0, 2, 1, 3)
    got = np.array(causal_attention(q, k, v, 0.5, backend=backend))
    np.testing.assert_allclose(got, attention64(q, k, v, 0.5), atol=5e-5, rtol=1e-4)


def test_attention_matches_mlx_fast_sdpa():
    rng = np.random.default_rng(4)
    q = mx.array(rng.standard_normal((2, 9, 100, 64)).astype(np.float32))
    k = mx.array(rng.standard_normal((2, 3, 100, 64)).astype(np.float32))
    v = mx.array(rng.standard_normal((2, 3, 100, 64)).astype(np.float32))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    assert mx.allclose(causal_attention(q, k, v, 0.125), want, atol=1e-5).item()


def test_attention_backends_agree():
    backends = attn_backends()
    rng = np.random.default_rng(5)
    q = mx.array(rng.standard_normal((2, 4, 40, 20)).astype(np.float32))
    k = mx.array(rng.standard_normal((2, 2, 40, 20)).astype(np.float32))
    outs = [np.array(causal_attention(q, k, k, 0.3, backend=b)) for b in backends]
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], atol=1e-5)


@pytest.mark.parametrize("backend", attn_backends())
@pytest.mark.parametrize("shape", [(1, 9, 3, 1, 128, 64), (2, 4, 2, 3, 40, 20), (1, 2, 1, 5, 17, 7)],
                         ids=lambda s: "x".join(map(str, s)))
def test_kv_len_reads_a_prefix_of_the_buffers(backend, shape):
    """kv_len cuts k/v to their first rows (a compiled decode step's filled
    cache prefix): float64 on the cut arrays, for every length from T to S,
    also when the length changes between runs of one compiled graph."""
    B, H, Hk, T, S, D = shape
    rng = np.random.default_rng(sum(shape))
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32))
               for s in ((B, H, T, D), (B, Hk, S, D), (B, Hk, S, D)))
    compiled = mx.compile(lambda n: causal_attention(q, k, v, 0.3, backend=backend, kv_len=n))
    for n in sorted({T, T + 1, (T + S) // 2, S - 1, S}):
        want = attention64(q, k[:, :, :n], v[:, :, :n], 0.3)
        for got in (causal_attention(q, k, v, 0.3, backend=backend, kv_len=mx.array(n)),
                    compiled(mx.array([n], dtype=mx.int32))):
            np.testing.assert_allclose(np.array(got), want, atol=2e-5, rtol=1e-4)
    # a length the buffers cannot hold is not known when the graph is built: NaN, no read past them
    for n in (T - 1, S + 1):
        assert np.isnan(np.array(causal_attention(q, k, v, 0.3, backend=backend, kv_len=mx.array(n)))).all()


def _views(B, Hk, cap, D, n, dtype, rng):
    """k and v as the first n rows of (B, Hk, cap, D) buffers (mlx-lm's
    KVCache hands a step keys[..., :offset, :]), and their contiguous copies."""
    bufs = [mx.array(rng.standard_normal((B, Hk, cap, D)).astype(np.float32)).astype(dtype) for _ in range(2)]
    views = [b[:, :, :n] for b in bufs]
    return views, [mx.array(np.array(x.astype(mx.float32))).astype(dtype) for x in views]


@pytest.mark.parametrize("backend", attn_backends())
@pytest.mark.parametrize("shape", [(1, 9, 3, 1, 300, 200, 64), (2, 4, 1, 1, 70, 33, 16),
                                   (3, 2, 2, 5, 40, 17, 8), (2, 6, 2, 40, 128, 100, 20)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_cache_prefix_views_read_in_place(backend, shape, dtype):
    """K and V that are the filled prefix of bigger buffers (heads one
    buffer length apart) are read where they lie: bit for bit the call on
    contiguous copies, with and without kv_len, batches and a single KV
    head included. A view of another layout (a transpose) is copied and
    gives the same."""
    B, H, Hk, T, cap, n, D = shape
    rng = np.random.default_rng(sum(shape))
    (k, v), (kc, vc) = _views(B, Hk, cap, D, n, dtype, rng)
    q = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32)).astype(dtype)
    want = causal_attention(q, kc, vc, 0.3, backend=backend)
    assert mx.array_equal(causal_attention(q, k, v, 0.3, backend=backend), want).item()
    # kv_len over the views: their first m rows
    m = (T + n) // 2
    cut = causal_attention(q, kc[:, :, :m], vc[:, :, :m], 0.3, backend=backend)
    assert mx.array_equal(causal_attention(q, k, v, 0.3, backend=backend, kv_len=mx.array(m)), cut).item()
    # k a prefix view, v transposed from (B, n, Hk, D): different layouts, both copied
    vt = mx.array(np.array(vc.astype(mx.float32)).transpose(0, 2, 1, 3)).astype(dtype).transpose(0, 2, 1, 3)
    assert mx.array_equal(causal_attention(q, k, vt, 0.3, backend=backend), want).item()
    # every other batch of the buffers: heads a buffer apart, batches not Hk buffers apart
    if B > 1:
        (k2, v2), _ = _views(2 * B, Hk, cap, D, n, dtype, rng)
        k2, v2 = k2[::2], v2[::2]
        k2c, v2c = (mx.array(np.array(x.astype(mx.float32))).astype(dtype) for x in (k2, v2))
        assert mx.array_equal(causal_attention(q, k2, v2, 0.3, backend=backend),
                              causal_attention(q, k2c, v2c, 0.3, backend=backend)).item()


HALF_EPS = {mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}  # unit roundoff


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("backend", attn_backends())
@pytest.mark.parametrize("shape", [(1, 8, 1, 300, 40), (2, 5, 5, 133, 12)],
                         ids=lambda s: "x".join(map(str, s)))
def test_half_precision_is_the_float32_computation(dtype, backend, shape):
    """The kernels read half-precision K and V as they are (no widened
    copies): the result is bit for bit the float32 call on the widened
    inputs, rounded once. Keys past the GEMM's chunks, head dims with
    column and dot-product tails, decode (kv_len) and prompts."""
    B, H, Hk, S, D = shape
    rng = np.random.default_rng(sum(shape))
    for T, n in ((1, S - 7), (1, None), (S // 2, None), (S, None)):
        q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)
                   for s in ((B, H, T, D), (B, Hk, S, D), (B, Hk, S, D)))
        kv_len = None if n is None else mx.array(n)
        got = causal_attention(q, k, v, 0.3, backend=backend, kv_len=kv_len)
        want = causal_attention(*(a.astype(mx.float32) for a in (q, k, v)), 0.3, backend=backend,
                                kv_len=kv_len).astype(dtype)
        assert got.dtype == dtype
        assert mx.array_equal(got, want).item(), (T, n)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("backend", attn_backends())
def test_half_precision_inputs(dtype, backend):
    """float16 / bfloat16 q, k, v: computed in float32 from the half values,
    one rounding on the output (float64 reference on the same half inputs);
    with kv_len too; the gradient equals MLX's sdpa's in float32 on the
    same values, rounded to the dtype."""
    rng = np.random.default_rng(11)
    B, H, Hk, S, D = 1, 6, 2, 40, 32
    for T, n in ((1, None), (1, 20), (9, None), (9, 20)):  # decode steps read K without transposing it
        q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)
                   for s in ((B, H, T, D), (B, Hk, S, D), (B, Hk, S, D)))
        kk, vv = (k, v) if n is None else (k[:, :, :n], v[:, :, :n])
        got = causal_attention(q, k, v, 0.2, backend=backend, kv_len=None if n is None else mx.array(n))
        assert got.dtype == dtype
        want = attention64(q.astype(mx.float32), kk.astype(mx.float32), vv.astype(mx.float32), 0.2)
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), want,
                                   atol=1e-5, rtol=HALF_EPS[dtype] + 1e-5)  # one rounding: unit roundoff
    # the backward: widened for the float32 kernel, rounded back
    g = mx.grad(lambda q, k, v: causal_attention(q, k, v, 0.2, backend=backend).astype(mx.float32).sum(), argnums=(0, 1, 2))(q, k, v)
    ref = mx.grad(lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal").sum(),
                  argnums=(0, 1, 2))(*(a.astype(mx.float32) for a in (q, k, v)))
    for a, b in zip(g, ref):
        assert a.dtype == dtype
        np.testing.assert_allclose(np.array(a.astype(mx.float32)), np.array(b), atol=2e-3, rtol=HALF_EPS[dtype])


def test_kv_len_is_checked_and_has_no_gradient():
    x = mx.zeros((1, 1, 2, 4))
    for bad in (3, mx.array([2, 3]), mx.array(2.0)):
        with pytest.raises(ValueError, match="kv_len"):
            causal_attention(x, x, x, 1.0, kv_len=bad)
    with pytest.raises(ValueError, match="no derivatives through a call with kv_len"):
        mx.grad(lambda q: causal_attention(q, x, x, 1.0, kv_len=mx.array(2)).sum())(x)


@pytest.mark.parametrize("args, match", [
    (((1, 2, 4, 8), (1, 2, 4), (1, 2, 4, 8)), "k must be 4-D"),
    (((1, 3, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), "multiple of the k/v heads"),
    (((1, 2, 5, 8), (1, 2, 4, 8), (1, 2, 4, 8)), "at least the query length"),
    (((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 5, 8)), "differs from v shape"),
    (((2, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), "differ in batch or head_dim"),
    (((1, 2, 4, 8), (1, 2, 4, 4), (1, 2, 4, 4)), "differ in batch or head_dim"),
])
def test_attention_bad_shapes(args, match):
    q, k, v = (mx.zeros(s) for s in args)
    with pytest.raises(ValueError, match=match):
        causal_attention(q, k, v, 1.0)


def test_attention_bad_dtype_scale_backend():
    x = mx.zeros((1, 1, 2, 4))
    with pytest.raises(TypeError, match="q must be float32, float16 or bfloat16"):
        causal_attention(x.astype(mx.int32), x, x, 1.0)
    with pytest.raises(TypeError, match="one dtype"):
        causal_attention(x.astype(mx.float16), x, x, 1.0)
    with pytest.raises(ValueError, match="scale must be finite"):
        causal_attention(x, x, x, float("nan"))
    with pytest.raises(ValueError, match="backend must be one of"):
        causal_attention(x, x, x, 1.0, backend="cuda")


# ------------------------------------------------------------------ swiglu


@pytest.mark.parametrize("backend", act_backends())
@pytest.mark.parametrize("n", [1, 7, 8, 255, 256, 257, 70001])
def test_swiglu_matches_float64(backend, n):
    rng = np.random.default_rng(n)
    g = rng.standard_normal(n).astype(np.float32) * 8
    u = rng.standard_normal(n).astype(np.float32)
    g[:4] = [0.0, -100.0, 100.0, -87.5][: min(4, n)]
    got = np.array(swiglu(mx.array(g), mx.array(u), backend=backend)).astype(np.float64)
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    want = g64 * u64 / (1 + np.exp(-g64))
    np.testing.assert_allclose(got, want, rtol=3e-6, atol=1e-30)


@pytest.mark.parametrize("backend", act_backends())
def test_swiglu_propagates_nan_and_inf(backend):
    g = mx.array([np.nan, np.inf, -np.inf, 1.0] * 3, dtype=mx.float32)
    u = mx.array([1.0, 2.0, 3.0, np.nan] * 3, dtype=mx.float32)
    got = np.array(swiglu(g, u, backend=backend))
    # silu(-inf) = -inf * sigmoid(-inf): NaN, as MLX's nn.silu gives.
    assert np.isnan(got[0]) and got[1] == np.inf and np.isnan(got[2]) and np.isnan(got[3])


def test_swiglu_matches_mlx_and_checks_input():
    g = mx.random.normal((3, 5, 40))
    u = mx.random.normal((3, 5, 40))
    assert mx.allclose(swiglu(g, u), nn.silu(g) * u, atol=1e-6).item()
    with pytest.raises(ValueError, match="differs from up shape"):
        swiglu(g, u[0])
    with pytest.raises(TypeError, match="up must be float32"):
        swiglu(g, u.astype(mx.bfloat16))


# ----------------------------------------------------------------- routing


def _counting(monkeypatch):
    from mixbits import _ext

    calls = {"attn": 0, "swiglu": 0}
    real_attn, real_act = _ext.causal_attention, _ext.swiglu

    def attn(*a):
        calls["attn"] += 1
        return real_attn(*a)

    def act(*a):
        calls["swiglu"] += 1
        return real_act(*a)

    monkeypatch.setattr(_ext, "causal_attention", attn)
    monkeypatch.setattr(_ext, "swiglu", act)
    return calls


def test_routing_is_per_model_and_keeps_logits(monkeypatch):
    calls = _counting(monkeypatch)
    routed, plain = tiny_llama(seed=0), tiny_llama(seed=0)
    tokens = mx.array(tiny_tokens(2, 40))
    before = plain(tokens)
    assert sorted(patch_functions(routed)) == sorted(["rms_norm", "rope", "scaled_dot_product_attention", "swiglu"] + _LINEAR)
    try:
        got = routed(tokens)
        mx.eval(got)
        assert calls == {"attn": 2, "swiglu": 2}  # 2 layers
        # The other model of the same architecture still runs MLX's ops.
        again = plain(tokens)
        mx.eval(again)
        assert calls == {"attn": 2, "swiglu": 2}
        assert mx.array_equal(again, before).item()
        assert mx.allclose(got, before, atol=1e-4).item()
        # Decode with a KV cache: the prompt goes to the kernel with S == T,
        # each one-token step (no mask) to the kernel with S > T = 1.
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(routed)
        routed(tokens[:1, :10], cache=cache)
        for t in range(10, 14):
            n = calls["attn"]
            step = routed(tokens[:1, t : t + 1], cache=cache)
            mx.eval(step)
            assert calls["attn"] == n + 2
            full = plain(tokens[:1, : t + 1])
            assert mx.allclose(step[0, -1], full[0, -1], atol=1e-4).item()
    finally:
        unpatch_functions(routed)
    n = dict(calls)
    mx.eval(routed(tokens))
    assert calls == n  # unpatched: nothing routed any more


def test_no_routing_where_only_the_scalar_kernel_exists(monkeypatch, request):
    """On a CPU where a kernel has only its scalar reference (x86 without
    AVX2), MLX's own op is faster: that function is not taken over."""
    from mixbits import _ext

    calls = _counting(monkeypatch)
    # The module-level routers stay once installed: install them first, so
    # the check must hold in the router, not only in patch_functions.
    first = tiny_llama(seed=0)
    patch_functions(first)
    unpatch_functions(first)
    ref_only = [b for b in _ext.act_backends() if names([b]) == ["ref"]]
    assert ref_only
    monkeypatch.setattr(_ext, "act_backends", lambda: ref_only)
    # The answer is cached per process: drop it now and after the test.
    _has_vector_kernel.cache_clear()
    request.addfinalizer(_has_vector_kernel.cache_clear)
    routed, plain = tiny_llama(seed=0), tiny_llama(seed=0)
    tokens = mx.array(tiny_tokens(1, 20))
    assert patch_functions(routed) == ["scaled_dot_product_attention", "rms_norm", "rope"] + _LINEAR
    try:
        got = routed(tokens)
        mx.eval(got)
        assert calls == {"attn": 2, "swiglu": 0}
        assert mx.allclose(got, plain(tokens), atol=1e-4).item()
    finally:
        unpatch_functions(routed)


def test_arm64_routes_decode_attention_only(monkeypatch, request):
    """Where the kernels' vector backend is NEON (arm64), SwiGLU and decode
    steps go to the kernels and prompts' attention stays with MLX (its CPU
    matmul is Accelerate's there); logits as the plain model's."""
    from mixbits import _ext
    from mlx_lm.models.cache import make_prompt_cache

    calls = _counting(monkeypatch)
    neon = [BACKENDS["ref"], BACKENDS["neon"]]
    monkeypatch.setattr(_ext, "attn_backends", lambda: neon)
    monkeypatch.setattr(_ext, "act_backends", lambda: neon)
    for cached in (_has_vector_kernel, _routes_prompt_attention):
        cached.cache_clear()
        request.addfinalizer(cached.cache_clear)
    routed, plain = tiny_llama(seed=0), tiny_llama(seed=0)
    tokens = mx.array(tiny_tokens(1, 14))
    assert sorted(patch_functions(routed)) == sorted(["rms_norm", "rope", "scaled_dot_product_attention", "swiglu"] + _LINEAR)
    try:
        cache = make_prompt_cache(routed)
        mx.eval(routed(tokens[:, :10], cache=cache))
        assert calls == {"attn": 0, "swiglu": 2}  # the prompt: SwiGLU only (2 layers)
        for t in range(10, 14):
            step = routed(tokens[:, t : t + 1], cache=cache)
            mx.eval(step)
            assert calls["attn"] == 2 * (t - 9)
            assert mx.allclose(step[0, -1], plain(tokens[:, : t + 1])[0, -1], atol=1e-4).item()
    finally:
        unpatch_functions(routed)
