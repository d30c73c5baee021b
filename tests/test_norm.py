"""The one-node RMSNorm (cpp/norm, python/mixbits/norm.py) against float64
numpy and MLX's own mx.fast.rms_norm, and its routing in patched models."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mixbits.norm import rms_norm
from mixbits.routing import patch_functions, unpatch_functions

from tiny_model import tiny_llama, tiny_tokens

FLOATS = [mx.float32, mx.float16, mx.bfloat16]
UNIT_ROUNDOFF = {mx.float32: 2.0**-24, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}


def rms_norm64(x, w, eps, out_dtype):
    """float64 normalization, rounded to the result dtype, times w, rounded
    again: the two roundings MLX's fallback makes."""
    x64 = np.array(x.astype(mx.float32)).astype(np.float64)
    n = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps)
    n = np.array(mx.array(n.astype(np.float32)).astype(out_dtype).astype(mx.float32)).astype(np.float64)
    return n * np.array(w.astype(mx.float32)).astype(np.float64)


@pytest.mark.parametrize("xd", FLOATS)
@pytest.mark.parametrize("wd", FLOATS)
@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 7, 64), (5,), (2, 3, 1), (130, 33)])
def test_matches_float64_and_mlx(xd, wd, shape):
    rng = np.random.default_rng(sum(shape))
    x = mx.array((rng.standard_normal(shape) * 3).astype(np.float32)).astype(xd)
    w = mx.array(rng.standard_normal(shape[-1:]).astype(np.float32)).astype(wd)
    y = rms_norm(x, w, 1e-5)
    out = mx.result_type(xd, wd)
    ref = mx.fast.rms_norm(x, w, 1e-5)
    assert y.dtype == ref.dtype == out and y.shape == x.shape
    u = UNIT_ROUNDOFF[out]
    want = rms_norm64(x, w, 1e-5, out)
    # the float32 sum of squares may flip the normalized value's rounding:
    # one unit of the result dtype on the normalized value, then one more
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), want, rtol=4 * u + 1e-6, atol=1e-30)
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                               rtol=4 * u + 1e-6, atol=1e-30)


def test_strided_input_and_zero_rows():
    rng = np.random.default_rng(1)
    base = mx.array(rng.standard_normal((64, 6)).astype(np.float32))
    x = base.T  # a transposed view: rows are strided
    w = mx.array(rng.standard_normal((64,)).astype(np.float32))
    np.testing.assert_allclose(np.array(rms_norm(x, w, 1e-6)), rms_norm64(x, w, 1e-6, mx.float32), rtol=1e-6)
    z = rms_norm(mx.zeros((2, 8)), mx.ones((8,)), 1e-5)  # 0 * rsqrt(eps): zeros, not NaN
    assert np.array_equal(np.array(z), np.zeros((2, 8)))


def test_gradients_are_mlx_ops():
    rng = np.random.default_rng(2)
    x = mx.array(rng.standard_normal((3, 40)).astype(np.float32))
    w = mx.array(rng.standard_normal((40,)).astype(np.float32))
    ours = mx.grad(lambda x, w: (rms_norm(x, w, 1e-5) ** 2).sum(), argnums=(0, 1))(x, w)
    mlx = mx.grad(lambda x, w: (mx.fast.rms_norm(x, w, 1e-5) ** 2).sum(), argnums=(0, 1))(x, w)
    for a, b in zip(ours, mlx):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    _, jv = mx.jvp(lambda x: rms_norm(x, w, 1e-5), [x], [mx.ones_like(x)])
    _, jm = mx.jvp(lambda x: mx.fast.rms_norm(x, w, 1e-5), [x], [mx.ones_like(x)])
    np.testing.assert_allclose(np.array(jv[0]), np.array(jm[0]), rtol=1e-5, atol=1e-6)


def test_bad_input():
    x = mx.zeros((2, 8))
    with pytest.raises(TypeError, match="x must be float32"):
        rms_norm(x.astype(mx.int32), mx.ones((8,)), 1e-5)
    with pytest.raises(TypeError, match="weight must be"):
        rms_norm(x, np.ones(8), 1e-5)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        rms_norm(x, mx.ones((7,)), 1e-5)
    with pytest.raises(ValueError, match="eps must be finite"):
        rms_norm(x, mx.ones((8,)), float("nan"))


def test_patched_model_routes_its_norms(monkeypatch):
    from mixbits import _ext

    calls = []
    real = _ext.rms_norm
    monkeypatch.setattr(_ext, "rms_norm", lambda *a: calls.append(a[0].shape) or real(*a))
    routed, plain = tiny_llama(seed=0), tiny_llama(seed=0)
    tokens = mx.array(tiny_tokens(2, 12))
    before = plain(tokens)
    assert "rms_norm" in patch_functions(routed)
    norms = [m for _, m in routed.named_modules() if isinstance(m, nn.RMSNorm)]
    assert len(norms) == 5  # 2 per layer and the final one
    try:
        got = routed(tokens)
        mx.eval(got)
        assert len(calls) == 5
        assert mx.allclose(got, before, atol=1e-4).item()
        # a norm called outside a routed model's call keeps MLX's op
        norms[0](mx.ones((1, 64)))
        assert len(calls) == 5
    finally:
        unpatch_functions(routed)
    assert all(type(m) is nn.RMSNorm for m in norms)
    mx.eval(routed(tokens))
    assert len(calls) == 5  # unpatched: nothing routed any more
