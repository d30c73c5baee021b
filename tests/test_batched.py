"""Weights with leading batch dimensions in mixbits.quantized_matmul /
qmatmul, against mx.quantized_matmul (transpose=True) and against the
dequantized stack multiplied by MLX's broadcasting matmul."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from mixbits.layout import BITS, GROUP_SIZES, QuantizedTensor, Segment

from reference import assert_matmul_close, to_f64

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
# Max error relative to the largest reference entry, for comparisons with
# MLX: both sides round the output to the dtype, MLX also rounds its
# dequantized weights (and may accumulate) in it. The float64 check in
# check_f64 is the tight one.
TOL = {mx.float32: 2e-5, mx.float16: 1e-2, mx.bfloat16: 8e-2}


def check_f64(got, x, wq, s, b, group_size, bits, perm=None):
    """got == x[..., perm] @ W.T within float32-accumulation + output
    rounding bounds, W dequantized by MLX in float32, product in float64."""
    W = to_f64(mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32),
                             group_size=group_size, bits=bits))
    xf = to_f64(x)
    if perm is not None:
        xf = xf[..., np.asarray(perm)]
    Wt = np.swapaxes(W, -1, -2)
    assert_matmul_close(got, xf @ Wt, np.abs(xf) @ np.abs(Wt))


def close(a, b, dtype, what=""):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    a = np.asarray(a.astype(mx.float32), dtype=np.float64)
    b = np.asarray(b.astype(mx.float32), dtype=np.float64)
    err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-6)
    assert err <= TOL[dtype], f"{what}: relative max error {err:.3g} > {TOL[dtype]}"


def rand(rng, shape, dtype=mx.float32):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


# (x batch, w batch): MLX broadcasts the dims before the last two.
BATCHES = [((3,), (3,)), ((2, 1), (3,)), ((1,), (4,)), ((2, 3), (2, 1)), ((5,), (1,))]


@pytest.mark.parametrize("bits,group_size", list(itertools.product(BITS, GROUP_SIZES)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_mx_quantized_matmul(bits, group_size, dtype):
    rng = np.random.default_rng(bits * 13 + group_size)
    n = int(rng.integers(1, 30))
    k = group_size * int(rng.integers(1, 4))
    m = int(rng.integers(1, 6))
    xb, wb = BATCHES[(bits + group_size) % len(BATCHES)]
    wq, s, b = mx.quantize(rand(rng, (*wb, n, k), dtype), group_size=group_size, bits=bits)
    x = rand(rng, (*xb, m, k), dtype)
    want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group_size, bits=bits)
    got = mixbits.quantized_matmul(x, wq, s, b, group_size=group_size, bits=bits)
    close(got, want, dtype, f"{xb} x {wb}")
    check_f64(got, x, wq, s, b, group_size, bits)


@pytest.mark.parametrize("xb,wb", BATCHES)
def test_every_broadcast_pattern(xb, wb):
    rng = np.random.default_rng(len(xb) * 10 + wb[0])
    wq, s, b = mx.quantize(rand(rng, (*wb, 9, 128)), group_size=64, bits=4)
    x = rand(rng, (*xb, 4, 128))
    want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4)
    got = mixbits.quantized_matmul(x, wq, s, b, group_size=64, bits=4)
    close(got, want, mx.float32)
    check_f64(got, x, wq, s, b, 64, 4)


def batched_tensor(rng, batch, n, specs, dtype, perm=True):
    """A mixed-segment stack: each matrix quantized by mixbits, stacked."""
    k = sum(s[2] for s in specs)
    p = rng.permutation(k) if perm else None
    e = int(np.prod(batch))
    qt = mixbits.quantize(rand(rng, (e * n, k), dtype), specs, perm=p, dtype=dtype)
    segs = [Segment(s.bits, s.group_size, s.k,
                    *(a.reshape(*batch, n, -1) for a in (s.wq, s.scales, s.biases)))
            for s in qt.segments]
    return QuantizedTensor(segs, qt.perm)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_segments_stack_with_perm(dtype):
    rng = np.random.default_rng(21)
    qt = batched_tensor(rng, (2, 3), 13, [(5, 32, 64), (3, 128, 128), (8, 64, 64)], dtype)
    assert qt.batch_shape == (2, 3) and qt.shape == (13, 256)
    W = qt.dequantize()  # (2, 3, 13, 256), permuted column order
    for xb in [(2, 3), (2, 1), (1, 3), (4, 2, 3)]:
        x = rand(rng, (*xb, 5, 256), dtype)
        got = mixbits.qmatmul(x, qt)
        want = mx.take(x, qt.perm, axis=-1) @ mx.swapaxes(W, -1, -2)
        close(got, want, dtype, str(xb))


def test_unbatched_x_with_batched_w_refused():
    # MLX multiplies such an x by w[0] only; a ValueError says what to do.
    rng = np.random.default_rng(2)
    wq, s, b = mx.quantize(rand(rng, (3, 8, 64)), group_size=32, bits=4)
    for shape in [(64,), (5, 64)]:
        with pytest.raises(ValueError, match="batch dimensions"):
            mixbits.quantized_matmul(rand(rng, shape), wq, s, b, group_size=32, bits=4)


def mlx_error(fn):
    try:
        mx.eval(fn())
    except Exception as e:  # noqa: BLE001 - we want its type
        return type(e)
    raise AssertionError("MLX accepted it")


def test_bad_batch_shapes_refused_as_mlx():
    rng = np.random.default_rng(3)
    wq, s, b = mx.quantize(rand(rng, (3, 8, 64)), group_size=32, bits=4)
    x = rand(rng, (2, 5, 64))
    etype = mlx_error(lambda: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=32, bits=4))
    with pytest.raises(etype):
        mx.eval(mixbits.quantized_matmul(x, wq, s, b, group_size=32, bits=4))
    # Scales whose batch differs from w's.
    etype = mlx_error(lambda: mx.quantized_matmul(x[:1], wq, s[:2], b[:2], transpose=True, group_size=32, bits=4))
    with pytest.raises(etype):
        mixbits.quantized_matmul(x[:1], wq, s[:2], b[:2], group_size=32, bits=4)


def test_gradients_through_batched_weights():
    """x, scales and biases gradients of a batched product equal those of
    MLX's own batched quantized_matmul."""
    rng = np.random.default_rng(4)
    wq, s, b = mx.quantize(rand(rng, (3, 10, 128)), group_size=64, bits=3)
    x = rand(rng, (2, 1, 4, 128))
    ct = rand(rng, (2, 3, 4, 10))
    ours = lambda x, s, b: mixbits.quantized_matmul(x, wq, s, b, group_size=64, bits=3)
    ref = lambda x, s, b: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=3)
    _, g = mx.vjp(ours, [x, s, b], [ct])
    _, gr = mx.vjp(ref, [x, s, b], [ct])
    for name, a, c in zip(("x", "scales", "biases"), g, gr):
        close(a, c, mx.float32, name)
    t = [rand(rng, a.shape) for a in (x, s, b)]
    _, (j,) = mx.jvp(ours, [x, s, b], t)
    # MLX has no jvp wrt scales: the same through mx.dequantize + matmul.
    dq = lambda x, s, b: x @ mx.swapaxes(mx.dequantize(wq, s, b, group_size=64, bits=3), -1, -2)
    _, (jr,) = mx.jvp(dq, [x, s, b], t)
    close(j, jr, mx.float32, "jvp")
