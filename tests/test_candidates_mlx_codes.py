"""A candidate quantizes the weight as MLX does: ``mx.quantize(w)`` on the
weight in its own dtype, the scales and biases then stored in the sweep's
scale dtype (float16). Quantizing ``w.astype(float16)`` instead moved a
share of a float32 checkpoint's codes, so a table's KL was not the KL of
mlx-lm's own quantization of that tensor."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mixbits.adapter import quantized_form
from mixbits.measure.candidates import build_layer, parse_candidate


def _weight(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    # Heavy-tailed rows of different scales: many values near a rounding
    # boundary once cast to float16.
    w = rng.standard_t(3, shape) * np.exp(rng.normal(0, 1.5, shape[:-1] + (1,)))
    return mx.array(w.astype(np.float32)).astype(dtype)


def _mlx(w, bits, gs):
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    return np.array(wq), np.array(s.astype(mx.float16)), np.array(b.astype(mx.float16))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("name", ["2b_g64", "3b_g32", "4b_g64", "6b_g128", "8b_g32"])
def test_linear_codes_are_mlx_quantize(name, dtype):
    lin = nn.Linear(256, 48, bias=False)
    lin.weight = _weight((48, 256), dtype)
    c = parse_candidate(name)
    (seg,) = quantized_form(build_layer(lin, c, mx.float16)).segments
    wq, s, b = _mlx(lin.weight, c.bits, c.group_size)
    np.testing.assert_array_equal(np.array(seg.wq), wq)
    assert seg.scales.dtype == seg.biases.dtype == mx.float16
    np.testing.assert_array_equal(np.array(seg.scales), s)
    np.testing.assert_array_equal(np.array(seg.biases), b)


def test_mixed_segments_are_mlx_quantize_of_their_columns():
    lin = nn.Linear(256, 48, bias=False)
    lin.weight = _weight((48, 256), mx.float32, seed=1)
    qt = quantized_form(build_layer(lin, parse_candidate("4b25_2b_g64"), mx.float16))
    w = lin.weight[:, mx.array(qt.perm)]
    k0 = 0
    for seg in qt.segments:
        wq, _, _ = _mlx(w[:, k0 : k0 + seg.k], seg.bits, seg.group_size)
        np.testing.assert_array_equal(np.array(seg.wq), wq)
        k0 += seg.k


def test_expert_stack_codes_are_mlx_quantize():
    from mlx_lm.models.switch_layers import SwitchLinear

    stack = SwitchLinear(128, 32, 4, bias=False)
    stack.weight = _weight((4, 32, 128), mx.float32, seed=2)
    q = build_layer(stack, parse_candidate("3b_g64"), mx.float16)
    wq, s, _ = _mlx(stack.weight, 3, 64)
    np.testing.assert_array_equal(np.array(q.weight), wq)
    np.testing.assert_array_equal(np.array(q.scales), s)
    assert q.scales.dtype == mx.float16
