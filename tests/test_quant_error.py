"""QuantizedTensor.weighted_error (cpp/quant_error) against float64 numpy.

The reference decodes the codes with layout.unpack_codes (numpy) and forms
s*q + b in float64: no MLX dequantize, no C++ on that side."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mixbits
from mixbits import _ext
from mixbits.adapter import dense_weight, weighted_weight_error
from mixbits.layout import BITS, GROUP_SIZES, quantize, unpack_codes


def reference(qt, w, weight):
    """sum(weight * (W - w)^2) in float64, W decoded segment by segment in
    stored column order and put back into the original order."""
    w = np.asarray(w, np.float64)
    parts = []
    for s in qt.segments:
        wq = np.array(s.wq).reshape(-1, s.wq.shape[-1])
        codes = unpack_codes(wq, s.bits).astype(np.float64)  # [rows, k]
        sc = np.array(s.scales.astype(mx.float32), np.float64).reshape(-1, s.k // s.group_size)
        bi = np.array(s.biases.astype(mx.float32), np.float64).reshape(-1, s.k // s.group_size)
        g = np.arange(s.k) // s.group_size
        parts.append(codes * sc[:, g] + bi[:, g])
    dense = np.concatenate(parts, axis=1).reshape(w.shape)
    if qt.perm is not None:
        dense = dense[..., np.argsort(np.array(qt.perm))]
    return float(np.sum(np.asarray(weight, np.float64) * (dense - w) ** 2))


def random_case(rng, rows, k, batch=()):
    w = rng.standard_normal((*batch, rows, k)).astype(np.float32)
    weight = rng.uniform(0, 3, size=w.shape).astype(np.float32)
    return w, weight


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_single_segment_every_bits_group_dtype(bits, group_size, dtype):
    rng = np.random.default_rng(bits * 1000 + group_size)
    rows = int(rng.integers(1, 40))
    k = group_size * int(rng.integers(1, 4))
    w, weight = random_case(rng, rows, k)
    qt = quantize(mx.array(w), [(bits, group_size, k)], dtype=dtype)
    assert qt.weighted_error(mx.array(w), mx.array(weight)) == pytest.approx(
        reference(qt, w, weight), rel=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_mixed_segments_with_perm_and_ternary(seed):
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 50))
    segs = [(3, 32, 64), ("ternary", 64, 64), (6, 32, 32), (8, 128, 128), (5, 64, 64)]
    k = sum(s[2] for s in segs)
    w, weight = random_case(rng, rows, k)
    qt = quantize(mx.array(w), segs, perm=rng.permutation(k), dtype=mx.float16)
    # Quantized from a *different* matrix: an error in every element.
    other = w + rng.standard_normal(w.shape).astype(np.float32)
    assert qt.weighted_error(other, weight) == pytest.approx(reference(qt, other, weight), rel=1e-5)


def test_batched_stack_and_numpy_inputs():
    rng = np.random.default_rng(7)
    w, weight = random_case(rng, 24, 128, batch=(3,))
    qt = mixbits.nn.quantize_stack(mx.array(w), [(4, 64, 64), (2, 32, 64)], dtype=mx.bfloat16)
    assert qt.batch_shape == (3,)
    assert qt.weighted_error(w, weight) == pytest.approx(reference(qt, w, weight), rel=1e-5)


def test_independent_of_thread_count():
    rng = np.random.default_rng(3)
    w, weight = random_case(rng, 333, 256)
    qt = quantize(mx.array(w), [(3, 64, 256)])
    saved = _ext.max_threads()
    try:
        _ext.set_max_threads(1)
        one = qt.weighted_error(w, weight)
        _ext.set_max_threads(0)
        many = qt.weighted_error(w, weight)
    finally:
        _ext.set_max_threads(saved)
    assert one == many


def test_zero_weight_and_exact_codes():
    rng = np.random.default_rng(4)
    w, weight = random_case(rng, 8, 64)
    qt = quantize(mx.array(w), [(4, 32, 64)])
    assert qt.weighted_error(w, np.zeros_like(weight)) == 0.0
    # Against its own dequantized matrix the error is zero (float rounding only).
    own = np.array(qt.dequantize(unpermute=True, dtype=mx.float32))
    assert qt.weighted_error(own, weight) < 1e-9 * reference(qt, w, weight)


def test_modules_stock_mixbits_and_float():
    """adapter.weighted_weight_error on the three module kinds equals the
    float64 sum over dense_weight."""
    rng = np.random.default_rng(5)
    lin = nn.Linear(128, 40, bias=False)
    w, weight = random_case(rng, 40, 128)
    stock = nn.QuantizedLinear.from_linear(lin, group_size=32, bits=3)
    mixed = mixbits.nn.MixedQuantizedLinear.from_linear(lin, [(2, 32, 64), (8, 64, 64)])
    for m in (stock, mixed, lin):
        want = float(np.sum(weight.astype(np.float64)
                            * (np.array(dense_weight(m), np.float64) - w) ** 2))
        got = weighted_weight_error(m, mx.array(w), mx.array(weight))
        assert got == pytest.approx(want, rel=1e-5), type(m).__name__


def test_bad_inputs_refused():
    rng = np.random.default_rng(6)
    w, weight = random_case(rng, 8, 64)
    qt = quantize(mx.array(w), [(4, 32, 64)])
    with pytest.raises(ValueError, match=r"w must have shape \(8, 64\)"):
        qt.weighted_error(w[:, :32], weight)
    with pytest.raises(ValueError, match="weight must have shape"):
        qt.weighted_error(w, weight[:4])
    s = qt.segments[0]
    args = (s.wq, s.scales, s.biases, mx.array(w), mx.array(weight))
    with pytest.raises(ValueError, match="bits must be"):
        _ext.weighted_quant_error(*args, 7, 32)
    with pytest.raises(ValueError, match="group_size must be"):
        _ext.weighted_quant_error(*args, 4, 48)
    with pytest.raises(ValueError, match="wq must be uint32"):
        _ext.weighted_quant_error(*args, 3, 32)  # 4-bit words read as 3-bit
    with pytest.raises(ValueError, match="weight must be float32"):
        _ext.weighted_quant_error(*args[:4], mx.array(weight).astype(mx.float16), 4, 32)
    with pytest.raises(ValueError, match="scales and biases"):
        _ext.weighted_quant_error(s.wq, s.scales, s.biases[:, :1], *args[3:], 4, 32)
