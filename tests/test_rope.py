"""The one-node RoPE (cpp/rope, python/mixbits/rope.py) against float64
numpy and MLX's own mx.fast.rope, and its routing in patched models."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mixbits.rope import rope
from mixbits.routing import patch_functions, unpatch_functions

from tiny_model import tiny_llama, tiny_tokens

UNIT_ROUNDOFF = {mx.float32: 2.0**-24, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}


def rope64(x, dims, traditional, base, scale, offset):
    """The rotation in float64 (exact angles) on x's values."""
    x = np.array(x.astype(mx.float32)).astype(np.float64)
    half, L = dims // 2, x.shape[-2]
    theta = ((offset + np.arange(L)) * scale)[:, None] * base ** (-np.arange(half) / half)[None]
    c, s = np.cos(theta), np.sin(theta)
    a = 2 * np.arange(half) if traditional else np.arange(half)
    b = a + 1 if traditional else a + half
    y = x.copy()
    y[..., a] = x[..., a] * c - x[..., b] * s
    y[..., b] = x[..., b] * c + x[..., a] * s
    return y


def tol(dtype, offset, L):
    # float32 angles: a few (position) * 2^-23 rad of error (MLX's op has
    # the same), on |x| of a few units; then one rounding of the output.
    return 5e-7 * (offset + L) + 4 * UNIT_ROUNDOFF[dtype] * 4


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims, D", [(64, 64), (32, 64), (2, 6)])
@pytest.mark.parametrize("offset", [0, 7, 1000])
def test_matches_float64_and_mlx(dtype, traditional, dims, D, offset):
    rng = np.random.default_rng(dims + D + offset)
    x = mx.array(rng.standard_normal((2, 3, 5, D)).astype(np.float32)).astype(dtype)
    want = rope64(x, dims, traditional, 10000.0, 0.5, offset)
    mlx = mx.fast.rope(x, dims, traditional=traditional, base=10000.0, scale=0.5, offset=offset)
    for off in (offset, mx.array(offset), mx.array([offset], dtype=mx.int64)):
        y = rope(x, dims, traditional=traditional, base=10000.0, scale=0.5, offset=off)
        assert y.dtype == dtype and y.shape == x.shape
        got = np.array(y.astype(mx.float32))
        t = tol(dtype, offset, 5)
        np.testing.assert_allclose(got, want, atol=t, rtol=0)
        np.testing.assert_allclose(got, np.array(mlx.astype(mx.float32)), atol=2 * t, rtol=0)
        # features past dims pass through unchanged
        np.testing.assert_array_equal(got[..., dims:], np.array(x.astype(mx.float32))[..., dims:])


def test_strided_input_and_compiled_offset():
    rng = np.random.default_rng(3)
    x = mx.array(rng.standard_normal((1, 4, 3, 16)).astype(np.float32)).transpose(0, 2, 1, 3)  # (1, 3, 4, 16) view
    f = mx.compile(lambda x, o: rope(x, 16, offset=o))
    for off in (0, 9, 300):  # one trace, the offset read at each run
        np.testing.assert_allclose(np.array(f(x, mx.array(off, dtype=mx.int32))),
                                   rope64(x, 16, False, 10000.0, 1.0, off), atol=tol(mx.float32, off, 4))


def test_gradient_is_mlx_ops():
    rng = np.random.default_rng(4)
    x = mx.array(rng.standard_normal((2, 3, 4, 32)).astype(np.float32))
    c = mx.array(rng.standard_normal((2, 3, 4, 32)).astype(np.float32))
    ours = mx.grad(lambda x: (rope(x, 32, offset=mx.array(5)) * c).sum())(x)
    mlx = mx.grad(lambda x: (mx.fast.rope(x, 32, traditional=False, base=10000.0, scale=1.0, offset=5) * c).sum())(x)
    np.testing.assert_allclose(np.array(ours), np.array(mlx), atol=1e-5)


def test_bad_input():
    x = mx.zeros((1, 2, 3, 8))
    with pytest.raises(TypeError, match="x must be float32"):
        rope(x.astype(mx.int32), 8)
    with pytest.raises(ValueError, match="dims must be an even int"):
        rope(x, 7)
    with pytest.raises(ValueError, match="dims must be an even int"):
        rope(x, 10)
    with pytest.raises(ValueError, match="at least 2 dims"):
        rope(mx.zeros((8,)), 8)
    with pytest.raises(ValueError, match="offset must be one integer"):
        rope(x, 8, offset=mx.array([1, 2]))
    with pytest.raises(TypeError, match="offset must be an int"):
        rope(x, 8, offset=1.5)
    with pytest.raises(ValueError, match="base must be finite"):
        rope(x, 8, base=0.0)


def test_patched_model_routes_its_ropes(monkeypatch):
    from mixbits import _ext

    calls = []
    real = _ext.rope
    monkeypatch.setattr(_ext, "rope", lambda *a: calls.append(a[0].shape) or real(*a))
    routed, plain = tiny_llama(seed=0), tiny_llama(seed=0)
    tokens = mx.array(tiny_tokens(2, 12))
    before = plain(tokens)
    assert "rope" in patch_functions(routed)
    ropes = [m for _, m in routed.named_modules() if isinstance(m, nn.RoPE)]
    assert len(ropes) == 2
    try:
        got = routed(tokens)
        mx.eval(got)
        assert len(calls) == 4  # q and k in each of 2 layers
        assert mx.allclose(got, before, atol=1e-4).item()
        # decode with a cache: int offsets
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(routed)
        routed(tokens[:1, :8], cache=cache)
        step = routed(tokens[:1, 8:9], cache=cache)
        assert mx.allclose(step[0, -1], plain(tokens[:1, :9])[0, -1], atol=1e-4).item()
    finally:
        unpatch_functions(routed)
    assert all(type(m) is nn.RoPE for m in ropes)
