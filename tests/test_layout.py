"""Packing logic (layout.py) against MLX's own quantized layout."""

import mlx.core as mx
import numpy as np
import pytest

from mixbits.layout import BITS, pack_codes, unpack_codes


@pytest.mark.parametrize("bits", BITS)
def test_pack_matches_mx_quantize_layout(bits):
    rng = np.random.default_rng(bits)
    w = mx.array(rng.standard_normal((5, 128)).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=32, bits=bits)
    codes = unpack_codes(np.array(wq), bits)
    # codes decoded our way reproduce MLX's dequantized values ...
    deq = codes.reshape(5, 4, 32) * np.array(s)[..., None] + np.array(b)[..., None]
    want = np.array(mx.dequantize(wq, s, b, group_size=32, bits=bits))
    np.testing.assert_allclose(deq.reshape(5, 128), want, atol=1e-6)
    # ... and packing them again gives MLX's exact words.
    np.testing.assert_array_equal(pack_codes(codes, bits), np.array(wq))


@pytest.mark.parametrize("bits", BITS)
def test_pack_roundtrip_random(bits):
    rng = np.random.default_rng(10 + bits)
    codes = rng.integers(0, 1 << bits, size=(3, 96))
    np.testing.assert_array_equal(unpack_codes(pack_codes(codes, bits), bits), codes)


def test_pack_rejects_bad_codes():
    with pytest.raises(ValueError, match="out of range"):
        pack_codes(np.full((1, 32), 4), 2)
    with pytest.raises(ValueError, match="whole words"):
        pack_codes(np.zeros((1, 7), dtype=int), 3)
