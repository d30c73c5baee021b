"""_ext.kv_write (cpp/cache/kv_write.h), the compiled decode step's cache
write: against mx.slice_update bit for bit (dtypes, slots past either end,
x read through views), a buffer held elsewhere left as it was, a buffer
handed over written in place, and clear refusals."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from mixbits import _ext

B, H, S, D = 2, 3, 9, 16


def rand(shape, seed, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def reference(buf, x, slot):
    start = mx.array([min(max(slot, 0), buf.shape[2] - 1)], dtype=mx.int32)
    return mx.slice_update(buf, x.astype(buf.dtype), start, axes=(2,))


@pytest.mark.parametrize("buf_dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("x_dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("slot", [0, 4, S - 1, S + 3, -2])
def test_matches_slice_update(buf_dtype, x_dtype, slot):
    mx.set_default_device(mx.cpu)
    buf = rand((B, H, S, D), 1, buf_dtype)
    x = rand((B, H, 1, D), 2, x_dtype)
    got = _ext.kv_write(buf, x, mx.array(slot, dtype=mx.int32))
    assert got.dtype == buf_dtype and got.shape == buf.shape
    assert mx.array_equal(got, reference(buf, x, slot)).item()


def test_values_through_the_models_views():
    """v as a model makes it: (B, 1, H*D) reshaped to heads and transposed;
    read through those views (no Reshape/Transpose node in the graph)."""
    mx.set_default_device(mx.cpu)
    buf = rand((B, H, S, D), 3)
    flat = rand((B, 1, H * D), 4)
    v = flat.reshape(B, 1, H, D).transpose(0, 2, 1, 3)
    got = _ext.kv_write(buf, v, mx.array(5))
    path = "/tmp/kv_write_graph.dot"
    mx.export_to_dot(path, got)
    names = re.findall(r'\[label ="?([A-Za-z_]+)', open(path).read())
    assert "Transpose" not in names and "KvWrite" in names, names
    assert mx.array_equal(got, reference(buf, v, 5)).item()


def test_a_buffer_held_elsewhere_is_left_as_it_was():
    mx.set_default_device(mx.cpu)
    buf = rand((B, H, S, D), 5)
    before = np.array(buf)
    got = _ext.kv_write(buf, rand((B, H, 1, D), 6), mx.array(2))
    mx.eval(got)
    np.testing.assert_array_equal(np.array(buf), before)
    assert not np.array_equal(np.array(got), before)


def test_a_buffer_handed_over_is_written_in_place():
    """32 MB buffer that only the node holds: the step's peak memory stays
    near one buffer (a copy would double it)."""
    mx.set_default_device(mx.cpu)
    shape = (1, 8, 1 << 16, 16)  # 32 MiB of float32
    x = rand((1, 8, 1, 16), 7)
    buf = mx.zeros(shape)
    mx.eval(buf, x)
    want = reference(mx.array(np.array(buf)), x, 77)
    mx.eval(want)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    got = _ext.kv_write(buf, x, mx.array(77))
    del buf  # the node holds the only reference now
    mx.eval(got)
    grew = mx.get_peak_memory() - base
    assert grew < (1 << 25) // 4, f"the write allocated {grew} bytes: a copy of the buffer"
    assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("args, match", [
    (lambda: (rand((H, S, D), 0), rand((B, H, 1, D), 0), mx.array(0)), "4-D float buffer"),
    (lambda: (rand((B, H, S, D), 0).astype(mx.int32), rand((B, H, 1, D), 0), mx.array(0)), "4-D float buffer"),
    (lambda: (rand((B, H, S, D), 0), rand((B, H, 2, D), 0), mx.array(0)), "x must be float of shape"),
    (lambda: (rand((B, H, S, D), 0), rand((B, H + 1, 1, D), 0), mx.array(0)), "x must be float of shape"),
    (lambda: (rand((B, H, S, D), 0), rand((B, H, 1, D), 0), mx.array(1.5)), "slot must be one integer"),
    (lambda: (rand((B, H, S, D), 0), rand((B, H, 1, D), 0), mx.array([1, 2])), "slot must be one integer"),
])
def test_bad_input_is_refused_before_any_node(args, match):
    mx.set_default_device(mx.cpu)
    with pytest.raises(ValueError, match="kv_write: .*" + re.escape(match)):
        _ext.kv_write(*args())


def test_no_derivative():
    mx.set_default_device(mx.cpu)
    buf, x = rand((B, H, S, D), 8), rand((B, H, 1, D), 9)
    with pytest.raises(ValueError, match="no derivative"):
        mx.eval(mx.grad(lambda v: _ext.kv_write(buf, v, mx.array(1)).sum())(x))
