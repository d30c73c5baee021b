"""Derivatives of the routed CPU kernels: causal attention (wrt q, k, v) and
SwiGLU (wrt gate and up), against float64 numpy and against MLX's own ops
differentiated by MLX (mx.fast.scaled_dot_product_attention(mask="causal"),
nn.silu(g) * u); and gradients through a patched tiny mlx-lm model equal to
the unpatched model's."""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mixbits
from mixbits import _ext
from mixbits.activations import act_backends
from mixbits.attention import attn_backends
from mixbits._backends import BACKENDS

import tiny_models
from reference import attention_vjp64, swiglu_vjp64

ATTN = [BACKENDS[b] for b in attn_backends()]
ACT = [BACKENDS[b] for b in act_backends()]


def rand(rng, shape, mult=1.0):
    return mx.array((rng.standard_normal(shape) * mult).astype(np.float32))


def qkv(seed, B, H, Hk, T, S, D, mult=1.0):
    rng = np.random.default_rng(seed)
    return (rand(rng, (B, H, T, D), mult), rand(rng, (B, Hk, S, D), mult),
            rand(rng, (B, Hk, S, D)), rand(rng, (B, H, T, D)))


def ours_vjp(q, k, v, dout, scale, backend=0, argnums=(0, 1, 2)):
    def f(*xs):
        args = [q, k, v]
        for a, x in zip(argnums, xs):
            args[a] = x
        return [_ext.causal_attention(*args, scale, backend)]
    out, grads = mx.vjp(f, [[q, k, v][a] for a in argnums], [dout])
    mx.eval(out, grads)
    return grads


def mlx_vjp(q, k, v, dout, scale):
    def f(q, k, v):
        return [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")]
    return mx.vjp(f, [q, k, v], [dout])[1]


def close(got, want, tol=3e-5):
    """|got - want| <= tol * max|want| (float32 sums of up to 257 terms)."""
    got, want = np.array(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * max(1.0, np.abs(want).max()))


def _cases():
    """Every T x head_dim pair, with batch, heads, KV heads (dividing them)
    and scale drawn from a fixed generator."""
    rng = np.random.default_rng(2024)
    out = []
    for T in (1, 5, 64, 257):
        for D in (16, 64, 128):
            B = int(rng.integers(1, 3))
            H = int(rng.integers(1, 10))
            Hk = int(rng.choice([d for d in range(1, H + 1) if H % d == 0]))
            scale = float(rng.choice([1 / math.sqrt(D), 0.05, 0.5, 1.3]))
            out.append((B, H, Hk, T, D, scale))
    out.append((2, 9, 3, 64, 64, 0.125))  # SmolLM2's head layout
    out.append((1, 9, 9, 5, 16, 2.0))
    return out


CASES = _cases()


@pytest.mark.parametrize("backend", ATTN)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}Hk{}T{}D{}s{:.3g}".format(*c))
def test_attention_vjp_matches_mlx_and_float64(backend, case):
    B, H, Hk, T, D, scale = case
    q, k, v, dout = qkv(hash(case) % 2**32, B, H, Hk, T, T, D)
    got = ours_vjp(q, k, v, dout, scale, backend)
    want64 = attention_vjp64(q, k, v, dout, scale)
    want_mlx = mlx_vjp(q, k, v, dout, scale)
    for name, g, w64, wm in zip("qkv", got, want64, want_mlx):
        assert g.dtype == mx.float32, name
        close(g, w64)
        close(g, wm)


@pytest.mark.parametrize("backend", ATTN)
@pytest.mark.parametrize("shape", [(1, 4, 2, 5, 40, 16), (2, 6, 3, 64, 100, 64),
                                   (1, 2, 1, 1, 70, 128), (1, 3, 1, 33, 97, 24),
                                   (2, 8, 8, 40, 60, 16)],  # 16 KV heads: one chunk each
                         ids=lambda s: "x".join(map(str, s)))
def test_attention_vjp_with_longer_keys(backend, shape):
    """S > T (queries are the last T positions, as over a KV cache); D = 24
    exercises the kernels' column tails; 16 KV heads take dK / dV in one
    chunk per head (fewer heads: 2-4 chunks added up)."""
    B, H, Hk, T, S, D = shape
    q, k, v, dout = qkv(7, B, H, Hk, T, S, D)
    got = ours_vjp(q, k, v, dout, 0.2, backend)
    for g, w, wm in zip(got, attention_vjp64(q, k, v, dout, 0.2), mlx_vjp(q, k, v, dout, 0.2)):
        close(g, w)
        close(g, wm)


@pytest.mark.parametrize("backend", ATTN)
def test_attention_vjp_peaked_and_strided(backend):
    """Large logits (one-hot-like rows, tiny P entries) and transposed views as
    mlx-lm passes them; the cotangent a broadcast (grad of a sum)."""
    rng = np.random.default_rng(3)
    B, T, H, Hk, D = 2, 45, 6, 3, 32
    q = rand(rng, (B, T, H, D), 6).transpose(0, 2, 1, 3)
    k = rand(rng, (B, T, Hk, D), 6).transpose(0, 2, 1, 3)
    v = rand(rng, (B, T, Hk, D)).transpose(0, 2, 1, 3)
    got = mx.grad(lambda q, k, v: _ext.causal_attention(q, k, v, 0.5, backend).sum(),
                  argnums=(0, 1, 2))(q, k, v)
    want = attention_vjp64(q, k, v, np.ones((B, H, T, D)), 0.5)
    for g, w in zip(got, want):
        close(g, w, 1e-4)


def test_attention_vjp_single_argnums():
    q, k, v, dout = qkv(11, 2, 4, 2, 20, 20, 16)
    full = ours_vjp(q, k, v, dout, 0.3)
    for a in range(3):
        (g,) = ours_vjp(q, k, v, dout, 0.3, argnums=(a,))
        assert mx.array_equal(g, full[a]).item()


def test_attention_vjp_thread_independent():
    """dK and dV are sums over query blocks, cut into a fixed number of
    chunks added in order: bitwise the same on one thread as on all."""
    q, k, v, dout = qkv(12, 2, 6, 3, 300, 300, 32)
    base = [np.array(g) for g in ours_vjp(q, k, v, dout, 0.17)]
    old = _ext.max_threads()
    try:
        _ext.set_max_threads(1)
        one = [np.array(g) for g in ours_vjp(q, k, v, dout, 0.17)]
    finally:
        _ext.set_max_threads(old)
    for b, o in zip(base, one):
        np.testing.assert_array_equal(o, b)


def test_attention_backward_uses_the_kernel():
    q, k, v, dout = qkv(13, 1, 2, 1, 8, 8, 16)
    _, vjps = mx.vjp(lambda q: [_ext.causal_attention(q, k, v, 0.3, 0)], [q], [dout])
    # The gradient's node is the CPU kernel, not a composition of MLX ops.
    import io
    buf = io.StringIO()
    mx.export_to_dot(buf, vjps[0])
    assert "CausalAttentionVJP" in buf.getvalue()
    assert "Matmul" not in buf.getvalue()


def test_attention_jvp_and_second_order_match_mlx():
    q, k, v, dout = qkv(14, 1, 4, 2, 12, 12, 16)
    rng = np.random.default_rng(15)
    tq, tk, tv = rand(rng, q.shape), rand(rng, k.shape), rand(rng, v.shape)
    ours = lambda q, k, v: _ext.causal_attention(q, k, v, 0.4, 0)
    ref = lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.4, mask="causal")
    for tangents in ((tq, tk, tv), (tq, mx.zeros_like(k), mx.zeros_like(v))):
        got = mx.jvp(lambda *a: [ours(*a)], [q, k, v], list(tangents))[1][0]
        want = mx.jvp(lambda *a: [ref(*a)], [q, k, v], list(tangents))[1][0]
        close(got, want)
    # jvp wrt k alone (argnums a strict subset).
    got = mx.jvp(lambda k: [ours(q, k, v)], [k], [tk])[1][0]
    want = mx.jvp(lambda k: [ref(q, k, v)], [k], [tk])[1][0]
    close(got, want)

    # d/dk of <dq, c>: the gradient's own vjp (second order).
    c = rand(rng, q.shape)

    def inner(fn):
        def h(k):
            dq = mx.grad(lambda q: (fn(q, k, v) * dout).sum())(q)
            return (dq * c).sum()
        return h
    close(mx.grad(inner(ours))(k), mx.grad(inner(ref))(k), 1e-4)


# --- SwiGLU --------------------------------------------------------------


def ours_swiglu_vjp(g, u, dy, backend=0):
    out, grads = mx.vjp(lambda g, u: [_ext.swiglu(g, u, backend)], [g, u], [dy])
    mx.eval(out, grads)
    return grads


def mlx_swiglu_vjp(g, u, dy):
    return mx.vjp(lambda g, u: [nn.silu(g) * u], [g, u], [dy])[1]


@pytest.mark.parametrize("backend", ACT)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 255), (2, 5, 1000), (70000,)],
                         ids=str)
def test_swiglu_vjp_matches_mlx_and_float64(backend, shape):
    rng = np.random.default_rng(len(shape) * 1000 + shape[-1])
    g, u, dy = rand(rng, shape, 4), rand(rng, shape), rand(rng, shape)
    got = ours_swiglu_vjp(g, u, dy, backend)
    for x, w64, wm in zip(got, swiglu_vjp64(g, u, dy), mlx_swiglu_vjp(g, u, dy)):
        np.testing.assert_allclose(np.array(x), w64, rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(np.array(x), np.array(wm), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ACT)
def test_swiglu_vjp_extremes(backend):
    """Large |g| (the exp's clamp), zero, +-inf and NaN: finite where MLX's
    gradient is finite (tiny values agree in absolute terms), NaN where it is."""
    g = mx.array([0.0, -0.0, 1e-30, 5.0, -5.0, 30.0, -30.0, 87.5, -87.5, 88.5, -88.5,
                  100.0, -100.0, 1e30, -1e30, np.inf, -np.inf, np.nan], mx.float32)
    u = mx.array(np.linspace(-2, 3, g.size).astype(np.float32))
    dy = mx.array(np.linspace(1, -1.5, g.size).astype(np.float32))
    got = ours_swiglu_vjp(g, u, dy, backend)
    want = mlx_swiglu_vjp(g, u, dy)
    for x, w in zip(got, want):
        x, w = np.array(x), np.array(w)
        np.testing.assert_array_equal(np.isnan(x), np.isnan(w))
        ok = ~np.isnan(w)
        np.testing.assert_allclose(x[ok], w[ok], rtol=1e-5, atol=1e-30)


def test_swiglu_vjp_strided_broadcast_cotangent_and_argnums():
    rng = np.random.default_rng(5)
    g = rand(rng, (64, 33), 3).T
    u = rand(rng, (33, 64))
    got = mx.grad(lambda g, u: _ext.swiglu(g, u, 0).sum(), argnums=(0, 1))(g, u)
    want = swiglu_vjp64(g, u, np.ones(g.shape))
    for x, w in zip(got, want):
        np.testing.assert_allclose(np.array(x), w, rtol=2e-6, atol=1e-6)
    only_u = mx.grad(lambda u: _ext.swiglu(g, u, 0).sum())(u)
    assert mx.array_equal(only_u, got[1]).item()


def test_swiglu_jvp_and_second_order_match_mlx():
    rng = np.random.default_rng(6)
    g, u, tg, tu = (rand(rng, (4, 300), 3) for _ in range(4))
    ours = lambda g, u: _ext.swiglu(g, u, 0)
    ref = lambda g, u: nn.silu(g) * u
    for f_args, tangents in (((g, u), (tg, tu)), ((g,), (tg,))):
        if len(f_args) == 2:
            a = mx.jvp(lambda g, u: [ours(g, u)], [g, u], [tg, tu])[1][0]
            b = mx.jvp(lambda g, u: [ref(g, u)], [g, u], [tg, tu])[1][0]
        else:
            a = mx.jvp(lambda g: [ours(g, u)], [g], [tg])[1][0]
            b = mx.jvp(lambda g: [ref(g, u)], [g], [tg])[1][0]
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)
    a = mx.jvp(lambda u: [ours(g, u)], [u], [tu])[1][0]
    b = mx.jvp(lambda u: [ref(g, u)], [u], [tu])[1][0]
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)
    # Second order: d/dg of sum(dgate(g) * c).
    c = rand(rng, g.shape)

    def inner(fn):
        return lambda g: (mx.grad(lambda g: (fn(g, u) * tu).sum())(g) * c).sum()
    np.testing.assert_allclose(np.array(mx.grad(inner(ours))(g)),
                               np.array(mx.grad(inner(ref))(g)), rtol=1e-4, atol=1e-5)


# --- through a patched mlx-lm model ----------------------------------------


def _counting(monkeypatch):
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


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_gradients_through_routed_kernels(monkeypatch, arch):
    """mx.grad through a patched model (routed attention and SwiGLU, now
    differentiated by their own kernels) equals the unpatched model's,
    wrt the input embeddings and wrt a projection weight."""
    plain, _ = tiny_models.build(arch, seed=3)
    routed, _ = tiny_models.build(arch, seed=3)
    mixbits.patch(routed)
    calls = _counting(monkeypatch)
    rng = np.random.default_rng(8)
    tokens = mx.array(rng.integers(0, 160, (2, 37)))
    targets = mx.array(rng.integers(0, 160, (2, 37)))
    emb = plain.model.embed_tokens(tokens)

    def loss(model):
        def f(e, w):
            model.model.layers[0].self_attn.q_proj.weight = w
            logits = model(tokens, input_embeddings=e)
            return nn.losses.cross_entropy(logits, targets).mean()
        return mx.grad(f, argnums=(0, 1))

    w0 = plain.model.layers[0].self_attn.q_proj.weight
    want = loss(plain)(emb, w0)
    got = loss(routed)(emb, routed.model.layers[0].self_attn.q_proj.weight)
    mx.eval(want, got)
    n_layers = len(routed.model.layers)
    assert calls == {"attn": n_layers, "swiglu": n_layers}, calls
    for g, w in zip(got, want):
        assert float(mx.abs(w).max()) > 0
        close(g, w, 1e-4)
