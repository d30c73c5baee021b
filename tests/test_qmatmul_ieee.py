"""IEEE semantics and argument types of the quantized matmul, as MLX has
them: an infinite x gives +-inf (NaN only where the weight is 0, or where
+inf and -inf meet), sizes past int32 in the checks, ValueError for bad
values and TypeError only for wrong Python types."""

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from mixbits.layout import QuantizedTensor, Segment


def _reference(x, qt):
    """float64 x @ W.T from mx.dequantize, W in stored column order."""
    w = np.array(qt.dequantize().astype(mx.float32), dtype=np.float64)
    xs = np.asarray(x, np.float64)
    if qt.perm is not None:
        xs = xs[..., np.array(qt.perm)]
    with np.errstate(invalid="ignore"):
        return xs @ w.T


@pytest.mark.parametrize("backend", mixbits.ops.available_backends())
def test_inf_in_x_matches_dequantize_reference(backend):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 256)).astype(np.float32)
    w[3, :] = 0.0  # an all-zero row: 0 * inf = NaN there, as in MLX
    qt = mixbits.quantize(mx.array(w), [(4, 64, 128), (3, 32, 128)], perm=rng.permutation(256))
    x = rng.standard_normal((3, 256)).astype(np.float32)
    x[0, 17] = np.inf
    x[2, 5], x[2, 200] = np.inf, -np.inf
    y = np.array(mixbits.qmatmul(mx.array(x), qt, backend=backend), dtype=np.float64)
    ref = _reference(x, qt)
    assert np.array_equal(np.isnan(y), np.isnan(ref)), backend
    assert np.array_equal(np.isposinf(y), np.isposinf(ref)) and np.array_equal(np.isneginf(y), np.isneginf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(y[fin], ref[fin], rtol=1e-4, atol=1e-4)
    assert np.isinf(y[0]).sum() > 30  # mostly +-inf, not a NaN row (NaN where a weight is exactly 0)
    # and MLX's own quantized matmul agrees on a one-segment weight
    s = qt.segments[0]
    xm = mx.array(x[:, :128])
    ours = np.array(mixbits.quantized_matmul(xm, s.wq, s.scales, s.biases, 64, 4, backend=backend))
    theirs = np.array(mx.quantized_matmul(xm, s.wq, s.scales, s.biases, group_size=64, bits=4))
    assert np.array_equal(np.isnan(ours), np.isnan(theirs)) and np.array_equal(np.isinf(ours), np.isinf(theirs))


def test_k_times_bits_past_int32_is_accepted():
    # 2**28 columns at 8 bits: 2**31 bits per row. Only the graph is built
    # (arrays stay lazy, nothing is allocated).
    k = 2**28
    seg = Segment(8, 128, k, mx.zeros((1, k // 4), mx.uint32), mx.zeros((1, k // 128), mx.float16),
                  mx.zeros((1, k // 128), mx.float16))
    qt = QuantizedTensor([seg])
    y = mixbits.qmatmul(mx.zeros((1, k), mx.float16), qt)
    assert y.shape == (1, 1)
    bad = Segment(8, 128, k, mx.zeros((1, k // 4 - 1), mx.uint32), seg.scales, seg.biases)
    with pytest.raises(ValueError, match=f"wq shape.*{k // 4}"):
        mixbits._ext.qmatmul(mx.zeros((1, k), mx.float16), None, [bad.wq, bad.scales, bad.biases], [(8, 128, k)])


def _triplet():
    wq, s, b = mx.quantize(mx.random.normal((16, 128), key=mx.random.key(0)), group_size=64, bits=4)
    return mx.zeros((2, 128)), wq, s, b


@pytest.mark.parametrize("which", ["scales", "biases"])
def test_integer_or_missing_scales_biases_are_value_errors(which):
    x, wq, s, b = _triplet()
    args = {"scales": s, "biases": b}
    args[which] = args[which].astype(mx.int32)
    with pytest.raises(ValueError, match=which):
        mixbits.quantized_matmul(x, wq, args["scales"], args["biases"], 64, 4)
    args[which] = None
    with pytest.raises(ValueError, match=f"{which} must be provided"):
        mixbits.quantized_matmul(x, wq, args["scales"], args["biases"], 64, 4)
    with pytest.raises(ValueError, match="must be provided"):  # MLX says the same
        mx.quantized_matmul(x, wq, s, None, group_size=64, bits=4)


def test_wrong_dtypes_are_value_errors_wrong_types_type_errors():
    x, wq, s, b = _triplet()
    with pytest.raises(ValueError, match="x must be float32"):
        mixbits.quantized_matmul(x.astype(mx.int32), wq, s, b, 64, 4)
    with pytest.raises(ValueError, match="uint32"):
        mixbits.quantized_matmul(x, wq.astype(mx.int32), s, b, 64, 4)
    with pytest.raises(ValueError, match="uint32"):  # MLX: also ValueError
        mx.quantized_matmul(x, wq.astype(mx.int32), s, b, group_size=64, bits=4)
    with pytest.raises(TypeError, match="bits must be an int"):
        mixbits.quantized_matmul(x, wq, s, b, 64, 4.0)
    with pytest.raises(TypeError):  # MLX: also TypeError for 4.0
        mx.quantized_matmul(x, wq, s, b, group_size=64, bits=4.0)
    with pytest.raises(TypeError, match=r"segments\[0\]: bits must be an int"):
        mixbits.quantize(mx.zeros((4, 128)), [(4.0, 64, 128)])
    with pytest.raises(TypeError, match="group_size must be an int"):
        QuantizedTensor([Segment(4, 64.0, 128, wq, s, b)])


def test_ternary_with_nan_weight_names_the_problem():
    w = np.ones((4, 128), np.float32)
    w[1, 7] = np.nan
    with pytest.raises(ValueError, match="NaN or infinite"):
        mixbits.quantize(mx.array(w), [("ternary", 64, 128)])


def test_dequantize_with_zero_rows():
    qt = QuantizedTensor([Segment(4, 64, 128, mx.zeros((0, 16), mx.uint32), mx.zeros((0, 2)), mx.zeros((0, 2)))])
    d = qt.dequantize()
    assert d.shape == (0, 128) and d.dtype == mx.float32
    assert mixbits.qmatmul(mx.ones((3, 128)), qt).shape == (3, 0)
