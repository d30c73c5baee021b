"""Repacked expert stacks: mixbits.repack of an (E, N, K) stack (each expert
row-interleaved on its own) is exactly undone by unrepack, gather_qmatmul
on it gives each expert's rows what qmatmul gives them on that expert's
repacked 2-D matrix (bit for bit; that path is checked against the
contract's numpy model in tests/test_repack.py), and MixedQuantizedSwitchLinear
/ patch(repack=True) hold their experts that way."""

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from int_contract import contract_model
from mixbits.errors import UsageError
from mixbits.ops import repack, repacked_kernels_available, unrepack
from mixbits.nn import MixedQuantizedSwitchLinear, repacked_layers, unrepack_layers
from test_gather_int8 import expert, per_expert, rand_stack

ACTS = ["int8", "int16", "int8-all", "float"]


@pytest.mark.parametrize("N", [37, 48])  # padded last blocks; whole blocks (one tall repack)
def test_repack_unrepack_stack_bit_for_bit(N):
    rng = np.random.default_rng(N)
    qt = rand_stack(rng, E=4, N=N)
    rt = repack(qt)
    assert rt.batch_shape == (4,) and rt.shape == qt.shape
    # each expert's slice is that expert's own repacked matrix
    one = repack(expert(qt, 2))
    for s, o in zip(rt.segments, one.segments):
        for a, b in [(s.wq_r[2], o.wq_r), (s.scales_r[2], o.scales_r), (s.biases_r[2], o.biases_r)]:
            np.testing.assert_array_equal(np.array(a), np.array(b))
    back = unrepack(rt)
    for a, b in zip(qt.arrays(), back.arrays()):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("N", [37, 48])
def test_gather_on_a_repacked_stack(act, N):
    assert repacked_kernels_available()  # x86 with AVX2 / arm64: what CI runs on
    rng = np.random.default_rng(10 + N)
    qt = rand_stack(rng, E=5, N=N)
    rt = repack(qt)
    T = 9
    x = mx.array(rng.standard_normal((T, 1, 1, qt.shape[1])).astype(np.float32))
    rhs = rng.integers(0, 5, (T, 2)).astype(np.uint32)
    got = np.array(mixbits.gather_qmatmul(x, rt, rhs_indices=mx.array(rhs), activations=act))
    np.testing.assert_array_equal(got, per_expert(x, qt, rhs, act, layout=repack))
    if act in ("int8", "int16"):  # the contract, independently
        y_star, *_, mag2, _ = contract_model(x[0, 0], expert(qt, int(rhs[0, 0])), act)
        np.testing.assert_array_less(np.abs(got[0, 0] - y_star), 4e-6 * mag2 + 1e-30)
    # the batched product (no indices) takes the same path per matrix
    xb = mx.array(rng.standard_normal((5, 2, qt.shape[1])).astype(np.float32))
    yb = np.array(mixbits.qmatmul(xb, rt, activations=act))
    for e in (0, 4):
        np.testing.assert_array_equal(yb[e], np.array(mixbits.qmatmul(xb[e], repack(expert(qt, e)),
                                                                      activations=act)))


def test_switch_layer_repack_and_patch():
    from test_switch_stacks import _stacks, _stock, _tokens

    model, _ = _stock("qwen3_moe")
    toks = _tokens(n=1)[:, :4]  # 4 tokens x top-2 of 4 experts: at most 8 rows per expert
    mixbits.patch(model, activations="int8")
    want = np.array(model(toks))
    stacks = _stacks(model, MixedQuantizedSwitchLinear)
    before = {p: [np.array(a) for a in m.quantized_tensor().arrays()] for p, m in stacks.items()}
    mixbits.patch(model, activations="int8", repack=True)
    assert set(stacks) <= set(repacked_layers(model))
    for p, m in stacks.items():
        assert m.is_repacked and m.num_experts == 4 and m.output_dims == before[p][0].shape[1]
    got = np.array(model(toks))
    # other kernels, the same contract: equal to float rounding
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    unrepack_layers(model)
    for p, m in stacks.items():
        assert not m.is_repacked
        for a, b in zip(before[p], m.quantized_tensor().arrays()):
            np.testing.assert_array_equal(a, np.array(b))
    np.testing.assert_array_equal(np.array(model(toks)), want)


def test_errors():
    rng = np.random.default_rng(3)
    qt = rand_stack(rng, E=2, N=16, segs=[(4, 32, 64)], perm=False)
    rt = repack(qt)
    x = mx.ones((1, 1, 1, 64))
    with pytest.raises(ValueError, match="stack of matrices"):
        mixbits.gather_qmatmul(x, repack(expert(qt, 0)), rhs_indices=mx.array([[0]]))
    with pytest.raises(ValueError, match="no gradient"):
        mx.grad(lambda v: mixbits.gather_qmatmul(v, rt, rhs_indices=mx.array([[1]]), activations="int8").sum())(x)
    with pytest.raises(ValueError, match="input features|K="):
        mixbits.gather_qmatmul(mx.ones((1, 1, 1, 32)), rt, rhs_indices=mx.array([[1]]))
    deep = mixbits.layout.QuantizedTensor([mixbits.layout.Segment(
        4, 32, 64, *(a[None] for a in (s.wq, s.scales, s.biases))) for s in qt.segments])
    with pytest.raises(UsageError, match="one batch dim"):
        repack(deep)


def test_compiled_nodes_on_one_weight_keep_their_contracts():
    # mx.compile merges nodes of one class whose inputs are the same arrays
    # and whose primitives say they are equivalent (then their consumers
    # read one of them): an int8 and an int16 product of one x with one
    # repacked weight (or expert stack) must stay two nodes, each giving
    # what it gives uncompiled.
    rng = np.random.default_rng(7)
    qt = rand_stack(rng, E=3, N=32)
    rt = repack(qt)
    rt2 = repack(expert(qt, 1))
    x = mx.array(rng.standard_normal((2, 1, qt.shape[1])).astype(np.float32))
    rhs = mx.array(np.array([[2], [0]], np.uint32))

    def both(x):
        ys = [mixbits.gather_qmatmul(x, rt, rhs_indices=rhs, activations="int8"),
              mixbits.gather_qmatmul(x, rt, rhs_indices=rhs, activations="int16"),
              mixbits.qmatmul(x, rt2, activations="int8"),
              mixbits.qmatmul(x, rt2, activations="int16")]
        return [y * 2 for y in ys]  # consumers: a merge would redirect them

    eager = [np.array(a) for a in both(x)]
    assert not np.array_equal(eager[0], eager[1]) and not np.array_equal(eager[2], eager[3])
    for got, want in zip(mx.compile(both)(x), eager):
        np.testing.assert_array_equal(np.array(got), want)
