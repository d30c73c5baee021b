"""mixbits.float_linear: float32/float16/bfloat16 x @ W.T (+ b) on the CPU
(OpenBLAS for many rows, a half-reading GEMV for a few), its gradients,
thread-independent results, and its routing by mixbits.patch.

References are independent: numpy float64 on the same (dtype-rounded)
inputs, with MLX's own matmul's error on the same case as a yardstick."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mixbits import _ext, float_linear
from mixbits.float_linear import float_matmul
from mixbits.routing import patch_functions, unpatch_functions
from tiny_model import tiny_llama, tiny_tokens

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
# Unit roundoff of each output dtype.
EPS = {mx.float32: 2.0**-24, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}
HAVE_BLAS = float_linear.blas_library() is not None
GEMV_BACKENDS = float_linear.available_backends()


def _arrays(shape_x, N, dtype, bias, seed):
    rng = np.random.default_rng(seed)
    K = shape_x[-1]
    x = mx.array(rng.standard_normal(shape_x).astype(np.float32)).astype(dtype)
    w = mx.array((rng.standard_normal((N, K)) / np.sqrt(max(K, 1))).astype(np.float32)).astype(dtype)
    b = mx.array(rng.standard_normal(N).astype(np.float32)).astype(dtype) if bias else None
    return x, w, b


def _f64(a):
    return np.array(a.astype(mx.float32), dtype=np.float64)


def _check(got, x, w, b, dtype, *, trans_a=False):
    """got against float64 on the same inputs: within float32 summation
    error (K u32 sum|x||w|, a worst-case bound a correct sum meets and a
    wrong element, transpose or missing bias does not) plus one rounding
    to the output dtype."""
    xf, wf = _f64(x), _f64(w)
    x2 = xf.reshape(-1, xf.shape[-1])
    a2 = x2.T if trans_a else x2
    ref = a2 @ wf.T
    mag = np.abs(a2) @ np.abs(wf).T
    if b is not None:
        ref = ref + _f64(b)
        mag = mag + np.abs(_f64(b))
    shape = (xf.shape[-1], wf.shape[0]) if trans_a else xf.shape[:-1] + (wf.shape[0],)
    assert got.shape == shape and got.dtype == dtype
    g = _f64(got).reshape(ref.shape)
    K = a2.shape[1]
    tol = (K + 2) * 2.0**-24 * mag + EPS[dtype] * np.abs(ref) + 1e-30
    err = np.abs(g - ref)
    assert np.all(err <= tol), f"max excess {np.max(err - tol)} (max err {err.max()})"
    return err


# K and N not multiples of 8 or 16, K = 1, and sizes past a block edge.
SHAPES = [(1, 1), (7, 3), (13, 29), (64, 130), (257, 77), (1000, 40)]
MS = [1, 2, 7, 64, 300]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K,N", SHAPES)
def test_matches_float64_and_mlx(dtype, K, N):
    for i, M in enumerate(MS):
        for bias in (False, True):
            x, w, b = _arrays((M, K), N, dtype, bias, seed=K * 7 + N + i)
            got = float_matmul(x, w, b)
            err = _check(got, x, w, b, dtype)
            # MLX's own op on the same inputs: ours is as close to float64.
            mlx = mx.addmm(b, x, w.T) if bias else x @ w.T
            mlx_err = np.abs(_f64(mlx) - _f64(got)) if dtype == mx.float32 else None
            if mlx_err is not None:
                assert err.max() <= max(2 * mlx_err.max(), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["gemv", "blas"])
def test_each_path_at_every_m(dtype, path):
    if path == "blas" and not HAVE_BLAS:
        pytest.fail("no BLAS found on Linux: numpy's OpenBLAS should be there")
    backends = GEMV_BACKENDS if path == "gemv" else [None]
    for backend in backends:
        for M in MS:
            for K, N in [(13, 29), (257, 77), (300, 130), (70, 1031)]:  # 1031: several BLAS blocks
                x, w, b = _arrays((M, K), N, dtype, True, seed=M + K)
                _check(float_matmul(x, w, b, path=path, backend=backend), x, w, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batched_leading_dims_and_mixed_dtypes(dtype):
    x, w, b = _arrays((2, 3, 5, 70), 33, dtype, True, seed=3)
    _check(float_matmul(x, w, b), x, w, b, dtype)
    x1, w1, _ = _arrays((70,), 33, dtype, False, seed=4)  # a 1-D x: shape (N,)
    _check(float_matmul(x1, w1), x1, w1, None, dtype)
    # A float32 x against a half weight: float32 out, as MLX promotes.
    xf = x.astype(mx.float32)
    _check(float_matmul(xf, w, b), xf, w, b, mx.float32)
    # A strided (transposed) x is read through its strides.
    xt = mx.swapaxes(x, 0, 1)
    _check(float_matmul(xt, w, b), xt, w, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (True, True)])
def test_transposed_forms(dtype, trans_a, trans_b):
    rng = np.random.default_rng(5)
    for path in ["auto", "gemv"] + (["blas"] if HAVE_BLAS else []):
        R, C, N = 45, 23, 19
        a = mx.array(rng.standard_normal((R, C)).astype(np.float32)).astype(dtype)
        K = R if trans_a else C
        w = mx.array(rng.standard_normal((N, K)).astype(np.float32)).astype(dtype)
        got = float_matmul(a, w if trans_b else w.T, trans_a=trans_a, trans_b=trans_b, path=path)
        _check(got, a, w, None, dtype, trans_a=trans_a)


def test_thread_independent():
    prev = _ext.max_threads()
    try:
        for dtype in DTYPES:
            for M in (1, 3, 300):
                x, w, b = _arrays((M, 515), 1031, dtype, True, seed=M)
                outs = []
                for n in (1, 2, 0):
                    _ext.set_max_threads(n)
                    y = float_matmul(x, w, b)
                    mx.eval(y)
                    outs.append(np.array(y.astype(mx.float32)))
                assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])
    finally:
        _ext.set_max_threads(prev)


def _mlx_ref(a, b, bias, trans_a, trans_b):
    a2 = a.reshape(-1, a.shape[-1])
    y = (a2.T if trans_a else a2) @ (b.T if trans_b else b)
    y = y + bias if bias is not None else y
    return y if trans_a else y.reshape(*a.shape[:-1], y.shape[-1])


@pytest.mark.parametrize("trans_a,trans_b", [(False, True), (False, False), (True, False), (True, True)])
def test_vjp_and_jvp_match_mlx(trans_a, trans_b):
    rng = np.random.default_rng(6)
    shape_a = (9, 14) if trans_a else (2, 5, 14)
    rows = 9 if trans_a else 10
    K = rows if trans_a else 14
    M = 14 if trans_a else rows
    N = 11
    a = mx.array(rng.standard_normal(shape_a).astype(np.float32))
    b = mx.array(rng.standard_normal((N, K) if trans_b else (K, N)).astype(np.float32))
    bias = mx.array(rng.standard_normal(N).astype(np.float32))
    out_shape = (M, N) if trans_a else (2, 5, N)
    g = mx.array(rng.standard_normal(out_shape).astype(np.float32))

    def ours(a, b, bias):
        return float_matmul(a, b, bias, trans_a=trans_a, trans_b=trans_b)

    def theirs(a, b, bias):
        return _mlx_ref(a, b, bias, trans_a, trans_b)

    _, got = mx.vjp(ours, [a, b, bias], [g])
    _, want = mx.vjp(theirs, [a, b, bias], [g])
    for x, y in zip(got, want):
        assert x.shape == y.shape
        assert np.allclose(np.array(x), np.array(y), atol=1e-4, rtol=1e-4)
    tangents = [mx.array(rng.standard_normal(t.shape).astype(np.float32)) for t in (a, b, bias)]
    _, jgot = mx.jvp(ours, [a, b, bias], tangents)
    _, jwant = mx.jvp(theirs, [a, b, bias], tangents)
    assert np.allclose(np.array(jgot[0]), np.array(jwant[0]), atol=1e-4, rtol=1e-4)
    # Second order: the vjp's own products differentiate too.
    f = lambda a: mx.sum(mx.grad(lambda a: mx.sum(ours(a, b, bias) ** 2))(a) ** 2)  # noqa: E731
    h = lambda a: mx.sum(mx.grad(lambda a: mx.sum(theirs(a, b, bias) ** 2))(a) ** 2)  # noqa: E731
    assert np.allclose(np.array(mx.grad(f)(a)), np.array(mx.grad(h)(a)), atol=1e-2, rtol=1e-4)


def test_half_gradients_keep_dtypes():
    x, w, b = _arrays((4, 6, 40), 24, mx.bfloat16, True, seed=8)
    gx, gw, gb = mx.grad(lambda x, w, b: mx.sum(float_matmul(x, w, b).astype(mx.float32)), argnums=(0, 1, 2))(x, w, b)
    assert (gx.dtype, gw.dtype, gb.dtype) == (mx.bfloat16,) * 3
    assert gw.shape == w.shape and gx.shape == x.shape and gb.shape == b.shape
    # d/dW sum(x W^T) = column sums of x; d/db = number of rows.
    want_w = np.broadcast_to(_f64(x).reshape(-1, 40).sum(0), (24, 40))
    assert np.allclose(_f64(gw), want_w, rtol=2e-2, atol=2e-2 * np.abs(want_w).max())
    assert np.allclose(_f64(gb), 24.0)


def test_errors():
    x, w, b = _arrays((3, 8), 5, mx.float32, True, seed=9)
    with pytest.raises(ValueError, match="inner sizes differ"):
        float_matmul(x, w.T)
    with pytest.raises(ValueError, match="bias must have shape"):
        float_matmul(x, w, b[:4])
    with pytest.raises(TypeError, match="a must be float32"):
        float_matmul(x.astype(mx.int32), w)
    with pytest.raises(ValueError, match="path must be one of"):
        float_matmul(x, w, path="fast")
    with pytest.raises(ValueError, match="b must be 2-D"):
        float_matmul(x, w[None])


def test_empty_sizes():
    x = mx.zeros((0, 8))
    w = mx.ones((5, 8))
    assert float_matmul(x, w).shape == (0, 5)
    # K = 0: the bias alone, as MLX's addmm gives.
    y = float_matmul(mx.zeros((3, 0)), mx.zeros((4, 0)), mx.arange(4, dtype=mx.float32))
    assert np.array_equal(np.array(y), np.tile(np.arange(4.0), (3, 1)))


def _counting(monkeypatch):
    """Count the routed calls: float_linear.linear is the router's entry."""
    calls = []
    real = float_linear.linear

    def counted(a, b, bias=None):
        calls.append(b.shape)
        return real(a, b, bias)

    monkeypatch.setattr(float_linear, "linear", counted)
    return calls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_patch_routes_float_linears(monkeypatch, dtype):
    if not HAVE_BLAS:
        pytest.fail("no BLAS found on Linux: numpy's OpenBLAS should be there")
    calls = _counting(monkeypatch)
    acts = []
    real_swiglu = _ext.swiglu
    monkeypatch.setattr(_ext, "swiglu", lambda g, u, b: (acts.append(g.dtype), real_swiglu(g, u, b))[1])
    routed, plain = tiny_llama(seed=2), tiny_llama(seed=2)
    for m in (routed, plain):
        m.set_dtype(dtype)
    tokens = mx.array(tiny_tokens(2, 12))
    want = plain(tokens)
    assert "linear" in patch_functions(routed)
    try:
        got = routed(tokens)
        mx.eval(got)
        # 2 layers x 7 linears, and the tied head's as_linear.
        assert len(calls) == 2 * 7 + 1 and calls[-1] == (256, 64)
        # SwiGLU in every dtype (half ones through the float32 kernel).
        assert acts == [mx.float32] * 2
        tol = {mx.float32: 1e-4, mx.float16: 3e-2, mx.bfloat16: 2e-1}[dtype]
        assert np.allclose(_f64(got), _f64(want), atol=tol)
        # A decoder block called directly (as a sweep does) is routed too.
        n = len(calls)
        h = routed.model.embed_tokens(tokens)
        mx.eval(routed.model.layers[0](h, mask="causal"))
        assert len(calls) == n + 7
        # Outside a routed call the layers are MLX's.
        mx.eval(routed.model.layers[0].mlp.up_proj(h))
        assert len(calls) == n + 7
    finally:
        unpatch_functions(routed)
    n = len(calls)
    mx.eval(routed(tokens))
    assert len(calls) == n


def test_patch_routes_biased_linears(monkeypatch):
    """A model whose projections have biases (qwen2's q/k/v): routed calls
    add them, as MLX's nn.Linear does."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen2

    args = qwen2.ModelArgs(model_type="qwen2", hidden_size=64, num_hidden_layers=1, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128,
                           tie_word_embeddings=False)
    models = []
    for _ in range(2):
        m = qwen2.Model(args)
        rng = np.random.default_rng(0)
        m.load_weights([(k, mx.array(rng.standard_normal(v.shape).astype(np.float32) * 0.3))
                        for k, v in tree_flatten(m.parameters())])
        models.append(m)
    routed, plain = models
    calls = _counting(monkeypatch)
    tokens = mx.array(tiny_tokens(1, 9, vocab=128))
    patch_functions(routed)
    try:
        got = routed(tokens)
        assert len(calls) == 7 + 1
        assert np.allclose(np.array(got), np.array(plain(tokens)), atol=1e-4, rtol=1e-4)
    finally:
        unpatch_functions(routed)


def test_patch_routes_gradients(monkeypatch):
    """Training through a routed model: the same gradients as MLX's."""
    routed, plain = tiny_llama(seed=3), tiny_llama(seed=3)
    tokens = mx.array(tiny_tokens(1, 10))
    patch_functions(routed)
    try:
        def loss(model):
            return lambda p: (model.update(p), mx.sum(model(tokens).astype(mx.float32) ** 2))[1]

        g1 = mx.grad(loss(routed))(routed.trainable_parameters())
        g2 = mx.grad(loss(plain))(plain.trainable_parameters())
        from mlx.utils import tree_flatten

        for (k1, v1), (k2, v2) in zip(tree_flatten(g1), tree_flatten(g2)):
            assert k1 == k2
            scale = float(mx.abs(v2).max()) + 1e-6
            assert np.allclose(np.array(v1), np.array(v2), atol=1e-3 * scale), k1
    finally:
        unpatch_functions(routed)


def test_without_blas_the_route_stays_with_mlx():
    """MIXBITS_BLAS=none: no BLAS, the float layers are MLX's, and
    float_matmul itself still computes (the GEMV at every M)."""
    code = (
        "import mlx.core as mx, numpy as np\n"
        "from mixbits import float_linear\n"
        "from mixbits.routing import patch_functions\n"
        "import sys; sys.path.insert(0, 'tests')\n"
        "from tiny_model import tiny_llama\n"
        "assert float_linear.blas_library() is None\n"
        "assert 'linear' not in patch_functions(tiny_llama())\n"
        "x = mx.random.normal((70, 33)); w = mx.random.normal((21, 33))\n"
        "assert np.allclose(np.array(float_linear.float_matmul(x, w)), np.array(x @ w.T), atol=1e-4)\n"
        "try:\n"
        "    float_linear.float_matmul(x, w, path='blas'); raise SystemExit('no error')\n"
        "except ValueError as e:\n"
        "    assert 'no BLAS' in str(e)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, MIXBITS_BLAS="none")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_routed_linears_are_measured_as_linears():
    """A routed nn.Linear is still a plain linear to the sweep (no own
    __call__ that would leave it float, unmeasured)."""
    from mixbits.adapter import ModelAdapter

    model = tiny_llama(seed=4)
    assert "linear" in patch_functions(model)
    try:
        sites = ModelAdapter(model).sites
        assert len(sites) == 2 * 7 + 1 and all(s.own_call is None for s in sites)
    finally:
        unpatch_functions(model)
