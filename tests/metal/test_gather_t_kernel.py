"""The gathered transposed product's Metal kernels (metal/gather_qmv_t.metal
with qmatmul_t.metal's perm check and unpermute: dx[lhs[i]] += dy[i] ·
W[rhs[i]] un-permuted, MixedGatherQMMT's eval_gpu, the gradient of the
gathered matmul wrt x), run unchanged on the SIMT emulator with the
primitive's own inputs.

The indices come from a MixedGatherQMM node (mixbits._ext.
gather_qmatmul_node_inputs: cast to uint32 and broadcast, as the vjp hands
them on); mixbits._ext.gather_qmatmul_t_node then builds MixedGatherQMMT
from them as the vjp does, on the CPU, and returns the arrays it is given
and its CPU output. Those arrays, byte for byte, go to the emulator, whose
harness checks their sizes against the launch plan eval_gpu uses
(metal/gather_t_host.h) and starts every output and scratch buffer
poisoned (an element no launch writes fails the run). The results are
compared with float64 numpy on mx.dequantize's W and with the CPU
primitive."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

import metal_emu as E
import mixbits
from mixbits import _ext
# emulator: the autouse fixture that builds the emulator (or skips), shared
from test_gather_kernel import mixed_stack, mlx_stack, u32
from test_metal_kernels import (ACT_OF, ACTS, BITS, GROUP_SIZES, MX_DTYPE, OUT_EPS,  # noqa: F401
                                assert_close, emulator, rand, to_storage)

# ---------------------------------------------------------------- helpers


def node(dy_of, x_shape, qt, lhs, rhs, perm="qt"):
    """(MixedGatherQMMT's inputs as storage, its CPU output, lhs, rhs) for
    the indices as a MixedGatherQMM node on x_shape holds them; dy_of(shape)
    makes dy for the node's output shape."""
    perm = qt.perm if isinstance(perm, str) else perm
    x = mx.zeros(x_shape, mx.float32)  # only its shape matters to the indices
    name, fwd = _ext.gather_qmatmul_node_inputs(x, perm, qt.arrays(), qt.specs, lhs, rhs)
    assert name == "MixedGatherQMM"
    li, ri = fwd[-2], fwd[-1]
    mx.eval(li, ri)
    N = qt.arrays()[0].shape[-2]
    dy = dy_of(tuple(li.shape) + (x_shape[-2], N))
    name, inputs, cpu = _ext.gather_qmatmul_t_node(dy, perm, qt.arrays(), qt.specs, li, ri,
                                                   list(x_shape))
    assert name == "MixedGatherQMMT"
    mx.eval(inputs, cpu)
    return [to_storage(a) for a in inputs], cpu, np.array(li), np.array(ri), dy


def emulate(inputs, qt, act, x_shape, has_perm, order="shuffle", seed=1):
    """Both plans: the grouping launch and the product, and (where it takes
    the problem: E.gather_t_fusable, the host's gt_fusable) the fused
    product alone, which must agree to the bit (each dx matrix sums the same
    pairs in the same order); where it does not, the plan refuses it."""
    Bx = int(np.prod(x_shape[:-2], dtype=np.int64))
    got = E.gather_t(inputs, qt.specs, act, ACT_OF[qt.dtype], has_perm, Bx,
                     order=order, seed=seed, fused=False)
    assert got.dtype == E.storage_dtype(act)
    K = sum(int(s[2]) for s in qt.specs)
    if E.gather_t_fusable(inputs[-1].size, K, has_perm):
        one = E.gather_t(inputs, qt.specs, act, ACT_OF[qt.dtype], has_perm, Bx,
                         order=order, seed=seed, fused=True)
        bits = np.uint32 if one.itemsize == 4 else np.uint16
        np.testing.assert_array_equal(one.view(bits), got.view(bits))
    else:
        with pytest.raises(E.EmulatorError, match="too many pairs or perm entries to fuse"):
            E.gather_t(inputs, qt.specs, act, ACT_OF[qt.dtype], has_perm, Bx,
                       order=order, seed=seed, fused=True)
    return got.reshape(x_shape)


def dense_w(qt):
    """float64 W [Bw, N, K] in packed column order, from mx.dequantize."""
    W = np.concatenate([np.array(mx.dequantize(s.wq, s.scales.astype(mx.float32),
                                               s.biases.astype(mx.float32),
                                               group_size=s.group_size, bits=s.bits),
                                 dtype=np.float64) for s in qt.segments], axis=-1)
    return W.reshape(-1, *W.shape[-2:])


def reference(dy, qt, li, ri, x_shape, perm=None):
    """float64 dx[b] = sum_{i: lhs[i] = b} unpermute(dy[i] @ W[rhs[i]]) and
    the same sum of |dy||W|, pair by pair in numpy (not the kernel's
    grouping)."""
    W = dense_w(qt)
    M, K = x_shape[-2:]
    d = np.array(dy.astype(mx.float32), np.float64).reshape(-1, M, W.shape[1])
    dx = np.zeros((int(np.prod(x_shape[:-2])), M, K))
    mag = np.zeros_like(dx)
    p = np.arange(K) if perm is None else np.array(perm)
    for i, (b, e) in enumerate(zip(li.reshape(-1), ri.reshape(-1))):
        dx[b][:, p] += d[i] @ W[e]
        mag[b][:, p] += np.abs(d[i]) @ np.abs(W[e])
    return dx.reshape(x_shape), mag.reshape(x_shape)


def check(x_shape, qt, lhs, rhs, act, seed=1, order="shuffle"):
    """Emulator vs float64 and vs the CPU primitive; returns (dx as float64,
    lhs, rhs) for further checks."""
    rng = np.random.default_rng(seed)
    inputs, cpu, li, ri, dy = node(lambda s: rand(rng, s, MX_DTYPE[act]), x_shape, qt, lhs, rhs)
    got = emulate(inputs, qt, act, x_shape, qt.perm is not None, order=order, seed=seed)
    ref, mag = reference(dy, qt, li, ri, x_shape, qt.perm)
    assert_close(got, act, ref, mag)
    g = E.storage_to_f64(got, act)
    c = E.storage_to_f64(to_storage(cpu), act)
    np.testing.assert_allclose(g, c, rtol=4 * OUT_EPS[act], atol=1e-4 * float(np.abs(c).max()))
    return g, li, ri


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("bits,gs", list(itertools.product(BITS, GROUP_SIZES)))
@pytest.mark.parametrize("act", ACTS)
def test_every_width_group_and_dtype(bits, gs, act):
    rng = np.random.default_rng(bits * 1000 + gs + 7 * ACTS.index(act))
    N = int(rng.choice([5, 13, 21]))  # partial 8-row slices
    k = 256 + gs                      # 3 column blocks, the last partial
    qt = mlx_stack(rng, 4, N, k, bits, gs, MX_DTYPE[act])
    M = int(rng.choice([1, 3]))
    # mlx-lm's unsorted SwitchGLU call: x (tokens, 1, M, K), rhs (tokens,
    # top 2), lhs defaulted: each token's two experts write one dx matrix.
    rhs = mx.array(rng.integers(0, 4, (3, 2)).astype(np.int32))
    check((3, 1, M, k), qt, None, rhs, act, seed=int(rng.integers(1 << 30)))
    # Both gathered, unsorted, repeated (int32 as callers pass them).
    lhs = mx.array(rng.permutation([0, 2, 2, 3, 0, 2]).astype(np.int32))
    rhs = mx.array(rng.integers(0, 4, 6).astype(np.int32))
    check((4, M, k), qt, lhs, rhs, act, seed=int(rng.integers(1 << 30)))


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("act", ACTS)
def test_mixed_segments_with_perm_repeated_and_unused_lhs(M, act):
    # Segment columns 128 | 64 | 96 | 640 | 32 | 128; 8 dx matrices, lhs
    # (2, 1) broadcast against rhs (3,): two dx matrices get three pairs
    # each (one expert twice), the other six none (exact zeros).
    rng = np.random.default_rng(100 + M + 10 * ACTS.index(act))
    specs = [(8, 128, 128), (6, 64, 64), (5, 32, 96), (4, 64, 640), (3, 32, 32), (2, 128, 128)]
    qt = mixed_stack(rng, 5, 11, specs, MX_DTYPE[act])
    lhs = u32([[6], [1]])
    rhs = u32([4, 0, 4])
    g, li, _ = check((4, 2, M, 1088), qt, lhs, rhs, act, seed=M)
    flat = g.reshape(8, M, 1088)
    untouched = np.setdiff1d(np.arange(8), li)
    assert (flat[untouched] == 0).all() and np.abs(flat[[1, 6]]).min() > 0


@pytest.mark.parametrize("act,scale_act", [(a, s) for a in ACTS for s in ACTS if a != s])
def test_scale_dtype_differs_from_dy(act, scale_act):
    rng = np.random.default_rng(5 + ACTS.index(act) + 3 * ACTS.index(scale_act))
    qt = mixed_stack(rng, 3, 9, [(5, 64, 128), (3, 32, 96)], MX_DTYPE[scale_act])
    check((4, 1, 2, 224), qt, None, u32(rng.integers(0, 3, (4, 2))), act)


def test_no_permutation_writes_dx_directly():
    rng = np.random.default_rng(31)
    qt = mixed_stack(rng, 3, 37, [(4, 32, 160), (6, 128, 256)], mx.float16, perm=False)
    assert qt.perm is None
    check((5, 1, 2, 416), qt, u32([3, 0, 3, 4, 3, 1]), u32([2, 2, 0, 1, 1, 0]), "float16")


def test_many_pairs_into_one_matrix_long_n_and_k():
    # 40 pairs, unsorted over 3 experts, all into the one dx matrix; N over
    # many 8-row slices, K over 17 column blocks.
    rng = np.random.default_rng(32)
    qt = mixed_stack(rng, 3, 61, [(4, 64, 2048), (8, 32, 64)], mx.float32)
    check((1, 1, 2112), qt, u32(np.zeros(40)), u32(rng.integers(0, 3, 40)), "float32")


def test_more_dx_matrices_than_group_threads():
    # 600 dx matrices: each of the grouping's 256 threads owns several
    # bins; unsorted lhs with repeats and gaps.
    rng = np.random.default_rng(33)
    qt = mixed_stack(rng, 4, 3, [(3, 32, 32)], mx.bfloat16)
    lhs = rng.integers(0, 600, 900)
    check((600, 1, 32), qt, u32(lhs), u32(rng.integers(0, 4, 900)), "bfloat16")


def test_sorted_prefill_layout():
    # mlx-lm's sorted call: x (tokens*top, 1, K) in expert order, lhs
    # defaulted (every dx matrix has exactly one pair), rhs sorted.
    rng = np.random.default_rng(34)
    qt = mlx_stack(rng, 6, 24, 128, 5, 64, mx.float16)
    rhs = np.sort(rng.integers(0, 6, 70))
    check((70, 1, 128), qt, None, u32(rhs.reshape(70, 1)), "float16")


@pytest.mark.parametrize("perm", [True, False])
@pytest.mark.parametrize("which", ["lhs", "rhs"])
def test_out_of_range_index_poisons_every_element_like_the_cpu(which, perm):
    # Guard pages after every input: a read through a bad index would fault.
    rng = np.random.default_rng(35)
    qt = mixed_stack(rng, 3, 10, [(4, 32, 64), (3, 32, 32)], mx.float32, perm=perm)
    lhs, rhs = np.array([0, 2, 1, 2]), np.array([0, 1, 2, 2])
    (lhs if which == "lhs" else rhs)[2] = 7
    x_shape = (4, 2, 96)
    inputs, cpu, *_ = node(lambda s: rand(rng, s), x_shape, qt, u32(lhs), u32(rhs))
    got = emulate(inputs, qt, "float32", x_shape, perm)
    assert np.isnan(got).all()
    assert np.isnan(np.array(cpu)).all()


class _Perm:
    """A QuantizedTensor with a perm it would refuse (the builders check
    only its shape and dtype)."""

    def __init__(self, qt, perm):
        self.perm, self.specs, self.dtype, self.arrays = perm, qt.specs, qt.dtype, qt.arrays
        self.segments = qt.segments


def test_bad_permutations_follow_the_cpu():
    rng = np.random.default_rng(36)
    qt = mixed_stack(rng, 2, 7, [(4, 32, 64), (5, 64, 64)], mx.float32)
    x_shape = (3, 2, 128)
    lhs, rhs = u32([2, 0, 2]), u32([1, 0, 0])
    # An entry out of range: NaN everywhere.
    perm = np.array(qt.perm)
    perm[17] = 128
    bad = _Perm(qt, mx.array(perm))
    inputs, cpu, *_ = node(lambda s: rand(rng, s), x_shape, bad, lhs, rhs, perm=bad.perm)
    assert np.isnan(emulate(inputs, bad, "float32", x_shape, True)).all()
    assert np.isnan(np.array(cpu)).all()
    # A repeated entry: its columns sum, the column it lost gets 0.
    perm = np.array(qt.perm)
    lost = perm[40]
    perm[40] = perm[3]
    rep = _Perm(qt, mx.array(perm))
    inputs, cpu, li, ri, dy = node(lambda s: rand(rng, s), x_shape, rep, lhs, rhs,
                                   perm=rep.perm)
    with E.counting() as rec:
        got = emulate(inputs, rep, "float32", x_shape, True)
    # The column-by-column path loads W by 4-byte words too (was bytes);
    # both plans (grouping + product, the fused product).
    assert [r["device_read_by_width"]["1"] for r in rec] == [0, 0, 0]
    W = dense_w(qt)
    d = np.array(dy, np.float64)
    want = np.zeros(x_shape)
    for i, (b, e) in enumerate(zip(li, ri)):
        np.add.at(want[b], (slice(None), perm), d[i] @ W[e])
    assert (got[:, :, lost] == 0).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(got, np.array(cpu), rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_thread_orders(order):
    rng = np.random.default_rng(37)
    qt = mixed_stack(rng, 3, 13, [(3, 32, 96), (5, 64, 192)], mx.bfloat16)
    check((3, 2, 288), qt, u32([2, 0, 2, 1, 2]), u32([1, 1, 0, 2, 2]), "bfloat16", order=order)


def test_harness_refuses_buffers_the_primitive_would_not_pass():
    # One expert's scales where the node holds the stack's: the launch
    # (planned from dy's and wq's shapes, as eval_gpu plans it) binds all
    # three experts' groups, so the harness refuses instead of running on
    # a re-layout; and int32 indices, which the node never holds.
    rng = np.random.default_rng(38)
    qt = mlx_stack(rng, 3, 8, 64, 4, 32, mx.float32)
    inputs, *_ = node(lambda s: rand(rng, s), (2, 1, 64), qt, None, u32([[0], [2]]))
    with pytest.raises(E.EmulatorError, match=r"scales \(buffer 7, float32\[48\]\)"):
        E.gather_t(inputs[:2] + [inputs[2][:1].copy()] + inputs[3:], qt.specs, "float32",
                   "float32", False, 2)
    with pytest.raises(TypeError, match="lhs must be uint32"):
        E.gather_t(inputs[:-2] + [inputs[-2].astype(np.int32), inputs[-1]], qt.specs,
                   "float32", "float32", False, 2)


def test_which_problems_the_kernels_take():
    """Up to MB_QT_MAX_M = 8 rows per matrix (MoE layers have 1), every
    count positive, 32-bit parameters and grids (x_batches + 1 bins);
    elsewhere MixedGatherQMM's vjp keeps dequantize + gather_mm."""
    assert E.gather_t_applies(16384, 1, 768, 2048, 2048, 128)
    assert E.gather_t_applies(8, 8, 5, 32, 1, 1)
    assert not E.gather_t_applies(8, 9, 5, 32, 1, 1)
    for zero in range(6):
        args = [8, 1, 5, 32, 4, 3]
        args[zero] = 0
        assert not E.gather_t_applies(*args), args
    assert not E.gather_t_applies(8, 1, 5, 32, 2**31 - 1, 3)
    assert not E.gather_t_applies(8, 2, 5, 2**30, 1, 3)  # x_batches * M * K
    # Up to 8 segments: the one product dispatch binds them all.
    assert E.gather_t_applies(8, 1, 5, 32, 1, 3, nseg=8)
    assert not E.gather_t_applies(8, 1, 5, 32, 1, 3, nseg=9)


def test_which_problems_the_fused_product_takes():
    """Up to 256 pairs (MB_GT_FUSED_MAX_PAIRS: the list each threadgroup
    keeps of its matrix's pairs) and, with a perm, K up to 65536
    (MB_QT_MAX_K: the dense kernel's K-bit map); without a perm K is no
    limit. The same rule decides gt_fused's first test and the forced plan's
    refusal (emulate, above)."""
    assert E.gather_t_fusable(1, 32, True)
    assert E.gather_t_fusable(256, 65536, True)
    assert not E.gather_t_fusable(257, 32, False)
    assert not E.gather_t_fusable(257, 32, True)
    assert not E.gather_t_fusable(8, 65537, True)
    assert E.gather_t_fusable(8, 65537, False)
    assert E.gather_t_fusable(256, 2**30, False)
