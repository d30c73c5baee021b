"""The integer-activation contracts on expert stacks: gather_qmatmul (and the
batched qmatmul, and MixedQuantizedSwitchLinear) with activations="int8",
"int16" or "int8-all" give each (row, expert) pair exactly what
mixbits.qmatmul gives that row on that expert's 2-D matrix, which
tests/int_contract.py's numpy model checks independently; an expert with
more than 16 rows, or rows with an inf or NaN, takes the float path."""

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from int_contract import CONTRACTS, contract_model
from mixbits import ops
from mixbits.layout import QuantizedTensor, Segment
from mixbits.nn import MixedQuantizedSwitchLinear, quantize_stack
from reference import to_f64

ACTS = sorted(CONTRACTS) + ["int8-all"]
BACKENDS = [b for b in ops.available_backends() if b != "neon"] + ["auto"]
SEGS = [(8, 32, 64), (4, 64, 128), (3, 32, 96), (2, 128, 128)]


def rand_stack(rng, E=5, N=37, segs=SEGS, perm=True):
    K = sum(k for _, _, k in segs)
    w = mx.array(rng.standard_normal((E, N, K)).astype(np.float32))
    return quantize_stack(w, segs, perm=rng.permutation(K) if perm else None, dtype=mx.float16)


def expert(qt, e):
    """Expert e of a stack as a 2-D QuantizedTensor (the same arrays, sliced)."""
    return QuantizedTensor([Segment(s.bits, s.group_size, s.k, s.wq[e], s.scales[e], s.biases[e], s.kind)
                            for s in qt.segments], qt.perm)


def per_expert(x, qt, rhs, act, backend="auto", layout=lambda w: w):
    """out[t, j] for x as mlx-lm's MoE layers pass it ((T, 1, M, K)), as the
    CPU kernel computes it: per expert, qmatmul of the rows of the pairs
    that chose it (in pair order) on that expert's 2-D matrix, stored as
    ``layout`` returns it (e.g. mixbits.ops.repack). (The SIMD kernels'
    rounding depends on how many rows a call has, so this is the
    bit-for-bit reference; the contract itself is checked against the
    independent numpy model.)"""
    T, J = rhs.shape
    M, N = x.shape[2], qt.shape[0]
    out = np.zeros((T, J, M, N), np.float32)
    flat = rhs.reshape(-1)
    for e in np.unique(flat):
        pairs = np.flatnonzero(flat == e)
        rows = mx.concatenate([x[int(p) // J, 0] for p in pairs])
        y = np.array(mixbits.qmatmul(rows, layout(expert(qt, int(e))), backend=backend, activations=act))
        for i, p in enumerate(pairs):
            out[p // J, p % J] = y[i * M:(i + 1) * M]
    return out


@pytest.mark.parametrize("act", ACTS)
def test_each_expert_runs_qmatmul_on_its_rows(act):
    rng = np.random.default_rng(1)
    qt = rand_stack(rng)
    T, K = 9, qt.shape[1]
    x = mx.array(rng.standard_normal((T, 1, 1, K)).astype(np.float32))  # decode-like: tokens x top-2
    rhs = rng.integers(0, 5, (T, 2)).astype(np.uint32)
    for b in BACKENDS:
        got = np.array(mixbits.gather_qmatmul(x, qt, rhs_indices=mx.array(rhs), backend=b, activations=act))
        want = per_expert(x, qt, rhs, act, backend=b)
        np.testing.assert_array_equal(got, want, err_msg=b)
        # ...and it is the integer contract, not the float product: the
        # independent numpy model of the contract agrees to float rounding.
        if act in CONTRACTS:
            for t, j in [(0, 0), (T - 1, 1)]:
                y_star, *_, mag2, _ = contract_model(x[t, 0], expert(qt, int(rhs[t, j])), act)
                np.testing.assert_array_less(np.abs(got[t, j] - y_star), 4e-6 * mag2 + 1e-30)
    assert not np.array_equal(got, np.array(mixbits.gather_qmatmul(x, qt, rhs_indices=mx.array(rhs))))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_x_and_lhs_indices(dtype):
    rng = np.random.default_rng(2)
    qt = rand_stack(rng, E=4, N=20, segs=[(4, 32, 128)], perm=False)
    x = mx.array(rng.standard_normal((3, 2, 128)).astype(np.float32)).astype(dtype)
    lhs, rhs = mx.array([2, 0, 1, 2]), mx.array([3, 3, 0, 1])
    got = mixbits.gather_qmatmul(x, qt, lhs, rhs, activations="int8")
    assert got.dtype == dtype and got.shape == (4, 2, 20)
    for i in range(4):
        want = mixbits.qmatmul(x[int(lhs[i])], expert(qt, int(rhs[i])), activations="int8")
        np.testing.assert_array_equal(to_f64(got[i]), to_f64(want))


def test_an_expert_with_more_than_16_rows_takes_the_float_path():
    rng = np.random.default_rng(3)
    qt = rand_stack(rng, E=3, N=24, segs=[(4, 64, 128)], perm=False)
    x = mx.array(rng.standard_normal((36, 1, 1, 128)).astype(np.float32))
    rhs = np.array([[0]] * 17 + [[1]] * 16 + [[2]] * 3, np.uint32)  # 17, 16 and 3 rows
    got = np.array(mixbits.gather_qmatmul(x, qt, rhs_indices=mx.array(rhs), activations="int8"))
    flt = np.array(mixbits.gather_qmatmul(x, qt, rhs_indices=mx.array(rhs)))
    np.testing.assert_array_equal(got[:17], flt[:17])
    np.testing.assert_array_equal(got[17:], per_expert(x[17:], qt, rhs[17:], "int8"))
    assert not np.array_equal(got[17:33], flt[17:33]) and not np.array_equal(got[33:], flt[33:])
    # int8-all: the integer contract at any number of rows
    every = np.array(mixbits.gather_qmatmul(x, qt, rhs_indices=mx.array(rhs), activations="int8-all"))
    np.testing.assert_array_equal(every, per_expert(x, qt, rhs, "int8-all"))
    np.testing.assert_array_equal(every[17:], got[17:])
    assert not np.array_equal(every[:17], flt[:17])


def test_inf_and_nan_rows_take_the_float_path():
    rng = np.random.default_rng(4)
    qt = rand_stack(rng, E=2, N=16, segs=[(4, 32, 64)], perm=False)
    xs = rng.standard_normal((4, 1, 1, 64)).astype(np.float32)
    rhs = mx.array(np.array([[0], [0], [1], [1]], np.uint32))
    xs[0, 0, 0, 5], xs[3, 0, 0, 7] = np.inf, np.nan  # expert 0's rows hold an inf, expert 1's a NaN
    x = mx.array(xs)
    got = np.array(mixbits.gather_qmatmul(x, qt, rhs_indices=rhs, activations="int8"))
    np.testing.assert_array_equal(got, np.array(mixbits.gather_qmatmul(x, qt, rhs_indices=rhs)))


def test_batched_qmatmul_takes_the_contract_per_matrix():
    rng = np.random.default_rng(5)
    qt = rand_stack(rng, E=3, N=21, segs=[(5, 32, 64), (6, 64, 64)])
    x = mx.array(rng.standard_normal((3, 2, 128)).astype(np.float32))
    got = np.array(mixbits.qmatmul(x, qt, activations="int16"))
    for e in range(3):
        np.testing.assert_array_equal(got[e], np.array(mixbits.qmatmul(x[e], expert(qt, e), activations="int16")))


def test_argument_errors():
    rng = np.random.default_rng(6)
    qt = rand_stack(rng, E=2, N=16, segs=[(4, 32, 64)], perm=False)
    x, rhs = mx.zeros((1, 1, 1, 64)), mx.array([[1]])
    with pytest.raises(ValueError, match="activations must be one of"):
        mixbits.gather_qmatmul(x, qt, rhs_indices=rhs, activations="int4")
    with pytest.raises(TypeError, match="activations must be a str"):
        mixbits.gather_qmatmul(x, qt, rhs_indices=rhs, activations=8)
    layer = MixedQuantizedSwitchLinear.from_tensor(qt)
    with pytest.raises(ValueError, match="activations must be one of"):
        layer.activations = "int4"


def test_switch_layer_runs_its_contract():
    rng = np.random.default_rng(7)
    qt = rand_stack(rng, E=4, N=32, segs=[(4, 64, 128)], perm=False)
    layer = MixedQuantizedSwitchLinear.from_tensor(qt)
    x = mx.array(rng.standard_normal((5, 1, 1, 128)).astype(np.float32))  # mlx-lm's (T, 1, 1, K)
    idx = mx.array(rng.integers(0, 4, (5, 2)))
    flt = np.array(layer(x, idx))
    layer.activations = "int8"
    got = np.array(layer(x, idx))
    want = np.array(mixbits.gather_qmatmul(x, qt, rhs_indices=idx, activations="int8"))
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, flt)
    assert np.abs(got - flt).max() <= 0.05 * np.abs(flt).max()
