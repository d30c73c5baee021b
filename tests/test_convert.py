"""Bulk float16 / bfloat16 <-> float32 conversions (cpp/common/convert.h),
which a half-precision model's attention, norms, rope and matmul inputs and
outputs go through: the SIMD version must give the scalar one's bits
(round to nearest even, NaN -> sign | 0x7e00), and both must equal numpy's
float16 rounding on every non-NaN value. (The NEON version is checked under
qemu: tests/test_convert_neon_emulated.py.)"""

import numpy as np
import pytest

from mixbits import _ext


def edge_values(rng):
    f16 = np.finfo(np.float16)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 65504.0, 65519.99, 65520.0,
                        -65520.0, 1e30, float(f16.tiny), float(f16.tiny) / 2, 2.0**-24, 2.0**-25,
                        2.0**-25 * 1.0000001, 3 * 2.0**-26, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11,
                        1e-45, -1e-40], np.float32)
    payload_nan = np.array([0x7f800001, 0xffc01234, 0x7fbfffff], np.uint32).view(np.float32)
    # ties at every exponent: halfway between two float16 values
    ties = (np.arange(1, 2049, dtype=np.float32) + 0.5) * np.float32(2.0**-10) * \
        np.float32(2.0) ** rng.integers(-24, 15, 2048).astype(np.float32)
    wide = rng.standard_normal(4000).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, 6, 4000)
    return np.concatenate([special, payload_nan, ties.astype(np.float32), wide.astype(np.float32)])


@pytest.mark.parametrize("n_offset", [0, 3, 7])  # tails after the 8-wide steps
def test_narrow_f16(n_offset):
    x = edge_values(np.random.default_rng(1))[n_offset:]
    ref = np.array(_ext.narrow_from_f32(x, 1, False), np.uint16)
    nan = np.isnan(x)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(ref[~nan], want[~nan])
    np.testing.assert_array_equal(ref[nan], (x[nan].view(np.uint32) >> 16 & 0x8000) | 0x7e00)
    simd = _ext.narrow_from_f32(x, 1, True)
    np.testing.assert_array_equal(np.array(simd, np.uint16), ref)


@pytest.mark.parametrize("dtype", [1, 2])
def test_widen(dtype):
    bits = np.arange(65536, dtype=np.uint16)  # every half pattern
    ref = np.array(_ext.widen_to_f32(bits, dtype, False), np.float32)
    want = bits.view(np.float16).astype(np.float32) if dtype == 1 else \
        (bits.astype(np.uint32) << 16).view(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(ref[~nan], want[~nan])
    assert np.isnan(ref[nan]).all()
    simd = np.array(_ext.widen_to_f32(bits, dtype, True), np.float32)
    np.testing.assert_array_equal(simd[~nan], ref[~nan])
    assert np.isnan(simd[nan]).all()


def test_narrow_bf16_and_bad_dtype():
    x = edge_values(np.random.default_rng(2))
    ref = np.array(_ext.narrow_from_f32(x, 2, False), np.uint16)
    simd = _ext.narrow_from_f32(x, 2, True)
    np.testing.assert_array_equal(np.array(simd, np.uint16), ref)
    with pytest.raises(ValueError):
        _ext.narrow_from_f32(x, 0, False)
