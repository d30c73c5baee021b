"""activations="int8" and "int16": the integer numeric contracts of the CPU
matmul (cpp/qmatmul_int8/kernel.h, bench/INT8.md); every test runs both. Checked against an independent
numpy model of the contract (float32 quantization, codes from MLX's own
dequantize, exact float64 sums), the scalar reference backend against that
model, every SIMD backend against the reference, and the documented error
bound against float64 x @ W.T; edge cases and the switches."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mixbits
from mixbits import ops
from mixbits.layout import QuantizedTensor, Segment
from int_contract import CONTRACTS, contract_model, rand_qt
from reference import OUT_EPS, dequantize_f64, to_f64

BACKENDS = [b for b in ops.available_backends() if b != "neon"] + ["auto"]


@pytest.fixture(params=sorted(CONTRACTS))
def act(request):
    return request.param


def run(x, qt, backend, act):
    return to_f64(mixbits.qmatmul(x, qt, backend=backend, activations=act)).reshape(-1, qt.shape[0])


def check_all(x, qt, act, out_dtype=mx.float32):
    """ref == model; every backend == ref to float rounding; the error bound
    vs float64 x @ W.T holds for every backend."""
    y_star, xhat, d, mag2, x64 = contract_model(x, qt, act)
    w = dequantize_f64(qt)
    y64 = x64 @ w.T
    ref = run(x, qt, "ref", act)
    oute = OUT_EPS[out_dtype]
    np.testing.assert_array_less(np.abs(ref - y_star), 2 * oute * np.abs(y_star) + 1e-9 * mag2 + 1e-30)
    # bound: |x - d x8| <= d/2 + 2^-22 |x| per element; tiny groups dropped whole
    tiny = (d == 0) * np.abs(x64)
    bound = (d / 2 + 2.0**-22 * np.abs(x64) + tiny) @ np.abs(w).T
    for b in BACKENDS:
        y = run(x, qt, b, act)
        np.testing.assert_array_less(np.abs(y - ref), 4e-6 * mag2 + 2 * oute * np.abs(ref) + 1e-30,
                                     err_msg=f"{b} vs ref")
        np.testing.assert_array_less(np.abs(y - y64), bound + 4e-6 * mag2 + 2 * oute * np.abs(y64) + 1e-30,
                                     err_msg=f"{b} vs float64 bound")
    return ref, y64, bound


# ---------------------------------------------------------------- contract


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_every_width_and_group_size(bits, gs, act):
    rng = np.random.default_rng(bits * 1000 + gs)
    qt = rand_qt(rng, 37, [(bits, gs, 512)])  # 37: tails of every row blocking
    for M in (1, 2, 3, 4, 5, 8, 9, 16):
        x = mx.array(rng.standard_normal((M, 512)).astype(np.float32))
        check_all(x, qt, act)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_mixed_segments_with_perm_and_dtypes(dtype, act):
    rng = np.random.default_rng(7)
    segs = [(8, 32, 64), (6, 64, 128), (5, 128, 128), (4, 64, 192), (3, 32, 96), (2, 128, 256)]
    qt = rand_qt(rng, 29, segs, perm=True, dtype=dtype if dtype != mx.float32 else mx.float16)
    for M in (1, 3, 8):  # 2*M rows: at most 16, the int8 path's limit
        x = mx.array(rng.standard_normal((2, M, qt.shape[1])).astype(np.float32)).astype(dtype)
        check_all(x, qt, act, dtype)


def test_rounding_is_half_even_and_codes_do_not_saturate(act):
    # Every code at its maximum (all bits set), scale 1, bias 0: y is an
    # integer sum, so any saturation of 16-bit pair sums shows. int8's sums
    # stay below 2^24 (exact in float); int16's reach 2^31, where float32
    # partial sums round: relative 1e-6 there (a saturation or an int32
    # overflow is off by far more), and less than half a code step (top)
    # in the rounding check, where one wrongly rounded column moves y by top.
    Q = CONTRACTS[act][0]
    rtol = 0 if act == "int8" else 1e-6
    K, N = 256, 5
    for bits in (2, 3, 4, 5, 6, 8):
        wq = mx.full((N, K * bits // 32), 0xFFFFFFFF, mx.uint32)
        qt = QuantizedTensor([Segment(bits, 64, K, wq, mx.ones((N, K // 64)), mx.zeros((N, K // 64)))])
        top = 2**bits - 1
        for sign in (1.0, -1.0):
            x = mx.full((1, K), sign * Q, mx.float32)
            for b in BACKENDS:
                want = sign * Q * top * K
                assert np.all(np.abs(run(x, qt, b, act) - want) <= rtol * abs(want)), (bits, b)
        # amax Q -> scale 1: x = 2.5 -> 2, 3.5 -> 4, -2.5 -> -2 (half-even)
        xs = np.zeros((1, K), np.float32)
        xs[0, 0::64] = Q
        xs[0, 1:5] = [2.5, 3.5, -2.5, 0.5]
        for b in BACKENDS:
            want = top * (4.0 * Q + 2 + 4 - 2 + 0)
            atol = 0 if act == "int8" else top / 2
            assert np.all(np.abs(run(mx.array(xs), qt, b, act) - want) <= atol), (bits, b)


def test_edge_cases_zero_groups_dynamic_range_tiny_groups(act):
    rng = np.random.default_rng(3)
    qt = rand_qt(rng, 23, [(4, 64, 256), (3, 32, 256)], perm=True)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    x[0] = 0.0                                  # all-zero row
    x[1, :128] = 0.0                            # zero groups
    x[2, ::7] *= 1e30                           # outliers inside groups
    x[3] *= np.float32(10.0) ** rng.integers(-30, 30, 512).astype(np.float32)  # wild range
    x[4] *= 1e-37                               # below 2^-119 (2^-111): groups count as zero
    x[5, :64] = 3e36                            # large, result still finite
    ref, y64, bound = check_all(mx.array(x), qt, act)
    assert np.all(ref[0] == 0.0)
    assert np.all(ref[4] == 0.0) and np.all(bound[4] > 0)


def test_inf_nan_take_the_float_path(act):
    rng = np.random.default_rng(4)
    qt = rand_qt(rng, 40, [(4, 64, 128), (3, 32, 128)], perm=True)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    for special in ([(0, 17, np.inf)], [(2, 5, np.inf), (2, 200, -np.inf)], [(1, 9, np.nan)]):
        xs = x.copy()
        for i, j, v in special:
            xs[i, j] = v
        for b in BACKENDS:
            f = np.array(mixbits.qmatmul(mx.array(xs), qt, backend=b))
            i8 = np.array(mixbits.qmatmul(mx.array(xs), qt, backend=b, activations=act))
            np.testing.assert_array_equal(i8, f)  # same bits, NaN and inf included


def test_more_than_16_rows_run_the_float_path(act):
    rng = np.random.default_rng(5)
    qt = rand_qt(rng, 33, [(4, 64, 256)])
    x = mx.array(rng.standard_normal((17, 256)).astype(np.float32))
    np.testing.assert_array_equal(np.array(mixbits.qmatmul(x, qt, activations=act)),
                                  np.array(mixbits.qmatmul(x, qt)))
    x16 = x[:16]
    assert not np.array_equal(np.array(mixbits.qmatmul(x16, qt, activations=act)),
                              np.array(mixbits.qmatmul(x16, qt)))


def test_threads_do_not_change_the_result(act):
    rng = np.random.default_rng(6)
    qt = rand_qt(rng, 301, [(4, 64, 512)])
    x = mx.array(rng.standard_normal((5, 512)).astype(np.float32))
    a = np.array(mixbits.qmatmul(x, qt, activations=act))
    old = mixbits._ext.max_threads()
    mixbits._ext.set_max_threads(1)
    try:
        b = np.array(mixbits.qmatmul(x, qt, activations=act))
    finally:
        mixbits._ext.set_max_threads(old)
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- switches


def test_argument_checks():
    rng = np.random.default_rng(8)
    qt = rand_qt(rng, 8, [(4, 64, 128)])
    x = mx.zeros((1, 128))
    with pytest.raises(ValueError, match="activations must be one of"):
        mixbits.qmatmul(x, qt, activations="int4")
    with pytest.raises(TypeError, match="activations must be a str"):
        mixbits.qmatmul(x, qt, activations=8)
    with pytest.raises(ValueError, match="activations must be one of"):  # the C++ op checks too
        mixbits._ext.qmatmul(x, qt.perm, qt.arrays(), qt.specs, 0, 4)
    s = qt.segments[0]
    y = mixbits.quantized_matmul(x + 1, s.wq, s.scales, s.biases, 64, 4, activations="int8")
    np.testing.assert_array_equal(np.array(y), np.array(mixbits.qmatmul(x + 1, qt, activations="int8")))
    stack = QuantizedTensor([Segment(4, 64, 128, mx.stack([s.wq] * 2), mx.stack([s.scales] * 2),
                                     mx.stack([s.biases] * 2))])
    # a stack takes the contract per matrix (tests/test_gather_int8.py)
    xb = mx.array(rng.standard_normal((2, 1, 128)).astype(np.float32))
    np.testing.assert_array_equal(np.array(mixbits.qmatmul(xb, stack, activations="int8")[1]),
                                  np.array(mixbits.qmatmul(xb[1], qt, activations="int8")))
    with pytest.raises(ValueError, match="activations must be one of"):  # the C++ gather checks too
        mixbits._ext.gather_qmatmul(xb, None, stack.arrays(), stack.specs, None, mx.array([0]),
                                    activations=4)


def test_layer_attribute_and_patch(act):
    rng = np.random.default_rng(9)
    lin = nn.Linear(256, 48)
    lin.weight = mx.array(rng.standard_normal((48, 256)).astype(np.float32))
    model = nn.Sequential(nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4))
    x = mx.array(rng.standard_normal((3, 256)).astype(np.float32))
    y_mlx = model(x)
    mixbits.patch(model, activations=act, functions=False)
    layer = model.layers[0]
    assert layer.activations == act
    qt = layer.quantized_tensor()
    want = mixbits.qmatmul(x, qt, activations=act) + layer.bias
    np.testing.assert_array_equal(np.array(model(x)), np.array(want))
    assert not np.array_equal(np.array(model(x)), np.array(y_mlx))
    layer.activations = "float"
    np.testing.assert_array_equal(np.array(model(x)), np.array(mixbits.qmatmul(x, qt) + layer.bias))
    with pytest.raises(ValueError, match="activations"):
        mixbits.patch(nn.Sequential(nn.Linear(4, 4)), activations="fp8")
    assert "activations" not in layer.parameters()  # not a parameter: save/load unchanged
