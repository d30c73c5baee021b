"""The gathered quantized matmul's Metal kernels (metal/gather_qmv.metal,
the GEMV; metal/gather_qmm.metal, the tiled kernel for many sorted rows or
M > 8), run unchanged on the SIMT emulator with MixedGatherQMM's own
inputs.

mixbits._ext.gather_qmatmul_node_inputs builds the node exactly as
gather_qmatmul does (indices cast to uint32 and broadcast, every input
dense) and returns the arrays the primitive is given; those arrays, byte
for byte, go to the emulator, whose harness checks their sizes against the
launch plan eval_gpu uses (metal/gather_host.h). The results are compared
with float64 numpy, with mx.gather_qmm (one segment) and with the CPU
primitive (NaN pattern of bad indices)."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

import metal_emu as E
import mixbits
from mixbits import _ext
from mixbits.layout import QuantizedTensor, Segment
# emulator: the autouse fixture that builds the emulator (or skips), shared
from test_metal_kernels import (ACT_OF, ACTS, BITS, GROUP_SIZES, MX_DTYPE, OUT_EPS,  # noqa: F401
                                assert_close, assert_near_mlx, emulator, rand, to_storage)

# ---------------------------------------------------------------- helpers

def mlx_stack(rng, E_, n, k, bits, gs, dtype):
    """One-segment expert stack quantized by mx.quantize (MLX's layout)."""
    wq, s, b = mx.quantize(rand(rng, (E_, n, k), dtype), group_size=gs, bits=bits)
    return QuantizedTensor([Segment(bits, gs, k, wq, s, b)])


def mixed_stack(rng, E_, n, specs, dtype, perm=True):
    """Expert stack (E, n, .) of one mixed layout, quantized by mixbits."""
    k = sum(s[2] for s in specs)
    qt = mixbits.quantize(rand(rng, (E_ * n, k)), specs,
                          perm=rng.permutation(k) if perm else None, dtype=dtype)
    segs = [Segment(s.bits, s.group_size, s.k,
                    *(a.reshape(E_, n, -1) for a in (s.wq, s.scales, s.biases)))
            for s in qt.segments]
    return QuantizedTensor(segs, qt.perm)


def node_inputs(x, qt, lhs, rhs):
    """The arrays MixedGatherQMM is given, as numpy storage (bf16 as bits)."""
    name, inputs = _ext.gather_qmatmul_node_inputs(x, qt.perm, qt.arrays(), qt.specs, lhs, rhs)
    assert name == "MixedGatherQMM"
    mx.eval(inputs)
    return [to_storage(a) for a in inputs]


def emulate(x, qt, lhs, rhs, order="shuffle", seed=1, sorted_indices=False):
    inputs = node_inputs(x, qt, lhs, rhs)
    act = ACT_OF[x.dtype]
    y = E.gather(inputs, qt.specs, act, ACT_OF[qt.dtype], qt.perm is not None,
                 sorted_indices=sorted_indices, order=order, seed=seed)
    assert y.dtype == E.storage_dtype(act)
    return y


def dequantized(s, as_stored=False):
    """A segment's W from mx.dequantize: with the scales as float32, or with
    as_stored, in the scales' own dtype, as mx.dequantize rounds it there."""
    if as_stored:
        w = mx.dequantize(s.wq, s.scales, s.biases, group_size=s.group_size, bits=s.bits)
    else:
        w = mx.dequantize(s.wq, s.scales.astype(mx.float32), s.biases.astype(mx.float32),
                          group_size=s.group_size, bits=s.bits)
    return np.array(w.astype(mx.float32), dtype=np.float64)


def reference(x, qt, lhs, rhs, as_stored=False):
    """float64 out[i] = x[lhs[i]][perm] @ W[rhs[i]].T and sum |x||w|, from
    mx.dequantize of every segment (as_stored: see dequantized); indices
    defaulted and broadcast as MLX does (numpy here, not the builder)."""
    W = np.concatenate([dequantized(s, as_stored) for s in qt.segments], axis=-1)
    x64 = np.array(x.astype(mx.float32), dtype=np.float64)
    if qt.perm is not None:
        x64 = x64[..., np.array(qt.perm)]
    xb, wb = x64.shape[:-2], W.shape[:-2]
    li = np.arange(int(np.prod(xb))).reshape(xb) if lhs is None else np.array(lhs)
    ri = np.arange(int(np.prod(wb))).reshape(wb) if rhs is None else np.array(rhs)
    li, ri = np.broadcast_arrays(li, ri)
    xs = x64.reshape(-1, *x64.shape[-2:])[li]
    Ws = np.swapaxes(W.reshape(-1, *W.shape[-2:])[ri], -1, -2)
    return xs @ Ws, np.abs(xs) @ np.abs(Ws)


def tiled_half_w(x, qt, lhs, rhs, sorted_indices):
    """Whether the kernel eval_gpu picks is the tiled one with a float16 W
    tile (x and the scales float16), which multiplies W as mx.dequantize
    gives it in float16 (as the dense tiled kernel and MLX's own do)."""
    if not (x.dtype == qt.dtype == mx.float16):
        return False
    xb = x.shape[:-2]
    wb = qt.segments[0].wq.shape[:-2]
    li = np.arange(int(np.prod(xb))).reshape(xb) if lhs is None else np.array(lhs)
    ri = np.arange(int(np.prod(wb))).reshape(wb) if rhs is None else np.array(rhs)
    pairs = np.broadcast(li, ri).size
    return E.gather_kernel(pairs, x.shape[-2], sorted_indices,
                           int(np.prod(wb))).startswith("mixbits_gather_qmm_")


def check(x, qt, lhs, rhs, seed=1, order="shuffle", sorted_indices=False):
    y = emulate(x, qt, lhs, rhs, order=order, seed=seed, sorted_indices=sorted_indices)
    ref, mag = reference(x, qt, lhs, rhs, tiled_half_w(x, qt, lhs, rhs, sorted_indices))
    assert_close(y, ACT_OF[x.dtype], ref, mag)
    return y


def u32(a):
    return mx.array(np.asarray(a).astype(np.uint32))


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("bits,gs", list(itertools.product(BITS, GROUP_SIZES)))
@pytest.mark.parametrize("act", ACTS)
def test_every_width_group_and_dtype_against_mx_gather_qmm(bits, gs, act):
    rng = np.random.default_rng(bits * 1000 + gs + 7 * ACTS.index(act))
    dt = MX_DTYPE[act]
    E_ = 4
    N = int(rng.choice([5, 13, 21]))      # partial 8-row blocks
    k = gs * int(rng.integers(1, 4))
    qt = mlx_stack(rng, E_, N, k, bits, gs, dt)
    seg = qt.segments[0]
    M = int(rng.integers(1, 4))
    # Tokens x top-2 experts (unsorted, repeated) and both operands gathered.
    for xb, lhs, rhs in [((5, 1), None, rng.integers(0, E_, (5, 2))),
                         ((3,), rng.integers(0, 3, (6,)), rng.integers(0, E_, (6,)))]:
        x = rand(rng, (*xb, M, k), dt)
        li = None if lhs is None else u32(lhs)
        ri = mx.array(rhs.astype(np.int32))  # int32 as callers pass; the builder casts
        y = check(x, qt, li, ri, seed=int(rng.integers(1 << 30)))
        want = mx.gather_qmm(x, seg.wq, seg.scales, seg.biases, li, ri, transpose=True,
                             group_size=gs, bits=bits, stream=mx.cpu)
        got = E.storage_to_f64(y, act)
        assert_near_mlx(got, np.array(want.astype(mx.float32), dtype=np.float64), act)


@pytest.mark.parametrize("M", [1, 3, 9])
@pytest.mark.parametrize("act", ACTS)
def test_mixed_segments_with_perm_and_batch_dims(M, act):
    rng = np.random.default_rng(100 + M + 10 * ACTS.index(act))
    specs = [(8, 128, 128), (6, 64, 64), (5, 32, 96), (4, 64, 640), (3, 32, 32), (2, 128, 128)]
    qt = mixed_stack(rng, 5, 11, specs, MX_DTYPE[act])
    K = qt.shape[1]
    x = rand(rng, (4, 2, M, K), MX_DTYPE[act])
    # lhs indexes the 8 flattened x matrices, rhs the 5 experts; unsorted,
    # repeated, with batch dims (2, 3) broadcast from (2, 1) and (3,).
    lhs = u32(rng.integers(0, 8, (2, 1)))
    rhs = u32(rng.permutation([4, 0, 4]))
    y = check(x, qt, lhs, rhs, seed=M)
    assert y.shape == (2, 3, M, 11)
    # And the CPU primitive on the same node inputs agrees. At M = 9 with
    # float16 x and scales the tiled kernel multiplies W rounded to float16
    # (each weight within 2^-11 of the CPU's float one), so up to 2^-11 of
    # sum |x||w| more apart.
    got = E.storage_to_f64(y, act)
    cpu = E.storage_to_f64(to_storage(mixbits.gather_qmatmul(x, qt, lhs, rhs)), act)
    tol = 4 * OUT_EPS[act] * np.abs(cpu) + 1e-4 * np.abs(cpu).max()
    if tiled_half_w(x, qt, lhs, rhs, False):
        tol = tol + 2.0**-11 * reference(x, qt, lhs, rhs)[1]
    assert (np.abs(got - cpu) <= tol).all(), np.abs(got - cpu).max()


@pytest.mark.parametrize("act,scale_act", [(a, s) for a in ACTS for s in ACTS if a != s])
def test_scale_dtype_differs_from_x(act, scale_act):
    rng = np.random.default_rng(5 + ACTS.index(act) + 3 * ACTS.index(scale_act))
    qt = mixed_stack(rng, 3, 9, [(5, 64, 128), (3, 32, 96)], MX_DTYPE[scale_act])
    x = rand(rng, (4, 1, 2, 224), MX_DTYPE[act])
    check(x, qt, None, u32(rng.integers(0, 3, (4, 2))))


def test_default_indices_broadcast_batches():
    # No indices: every x matrix against every expert by broadcasting the
    # batch shapes (2, 1) and (3,), as mx.quantized_matmul with batched w.
    rng = np.random.default_rng(21)
    qt = mixed_stack(rng, 3, 7, [(4, 32, 64), (6, 64, 64)], mx.float16, perm=False)
    x = rand(rng, (2, 1, 3, 128), mx.float16)
    y = check(x, qt, None, None)
    assert y.shape == (2, 3, 3, 7)


def test_many_pairs_of_few_experts_long_k():
    # K over several 512-column GEMV blocks; 40 pairs on 2 experts.
    rng = np.random.default_rng(22)
    qt = mlx_stack(rng, 2, 9, 2048 + 64, 4, 64, mx.float32)
    x = rand(rng, (40, 1, 1, 2048 + 64))
    check(x, qt, None, u32(np.r_[np.zeros(30), np.ones(10)].reshape(40, 1)))


@pytest.mark.parametrize("segments", [1, 3])
def test_out_of_range_indices_give_nan_matrices_like_the_cpu(segments):
    # Guard pages after every input: a read of x or W past its last matrix
    # would fault. Index -1 arrives as 2^32 - 1 (the builder casts to uint32).
    rng = np.random.default_rng(23)
    specs = [(4, 32, 64)] if segments == 1 else [(4, 32, 64), (3, 32, 32), (8, 64, 64)]
    qt = mixed_stack(rng, 3, 10, specs, mx.float32)
    x = rand(rng, (4, 2, qt.shape[1]))
    lhs = mx.array(np.array([0, 4, 2, 1, 3, 2], np.int32))
    rhs = mx.array(np.array([0, 1, 3, -1, 2, 2], np.int32))
    y = E.storage_to_f64(emulate(x, qt, lhs, rhs), "float32")
    bad = np.array([False, True, True, True, False, False])
    assert np.isnan(y[bad]).all()
    assert np.isfinite(y[~bad]).all()
    cpu = np.array(mixbits.gather_qmatmul(x, qt, lhs, rhs))
    np.testing.assert_array_equal(np.isnan(cpu).all(axis=(1, 2)), bad)
    ok = mx.array(~bad)  # the good pairs' reference, bad ones read matrix 0
    ref, mag = reference(x, qt, mx.where(ok, lhs, 0), mx.where(ok, rhs, 0))
    assert_close(y[~bad], "float32", ref[~bad], mag[~bad])


def test_bad_permutation_entry_poisons_every_output_like_the_cpu():
    # QuantizedTensor refuses such a perm; the builder takes it (checks its
    # shape only), and both evaluations must then give NaN, not garbage.
    class BadPerm:
        def __init__(self, qt, perm):
            self.perm, self.specs, self.dtype = perm, qt.specs, qt.dtype
            self.arrays = qt.arrays

    rng = np.random.default_rng(24)
    qt = mixed_stack(rng, 2, 6, [(4, 32, 64), (2, 32, 32)], mx.float32)
    perm = np.array(qt.perm)
    perm[17] = 96
    bad = BadPerm(qt, mx.array(perm))
    x = rand(rng, (3, 1, 96))
    lhs, rhs = u32([0, 2, 1]), u32([1, 0, 1])
    assert np.isnan(E.storage_to_f64(emulate(x, bad, lhs, rhs), "float32")).all()
    cpu = _ext.gather_qmatmul(x, bad.perm, qt.arrays(), qt.specs, lhs, rhs, False, 0)
    assert np.isnan(np.array(cpu)).all()


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_thread_orders(order):
    rng = np.random.default_rng(25)
    qt = mixed_stack(rng, 3, 13, [(3, 32, 96), (5, 64, 64)], mx.bfloat16)
    check(rand(rng, (3, 2, 160), mx.bfloat16), qt, u32([2, 0, 2, 1]), u32([1, 1, 0, 2]),
          order=order)


def test_harness_refuses_buffers_the_primitive_would_not_pass():
    # One expert's scales where the node holds the stack's: the launch
    # (planned from x's and wq's shapes, as eval_gpu plans it) binds all
    # three experts' groups, so the harness refuses instead of running the
    # kernel on a re-layout.
    rng = np.random.default_rng(26)
    qt = mlx_stack(rng, 3, 8, 64, 4, 32, mx.float32)
    x = rand(rng, (2, 1, 64))
    inputs = node_inputs(x, qt, None, u32([[0], [2]]))
    with pytest.raises(E.EmulatorError, match=r"scales \(buffer 7, float32\[48\]\)"):
        E.gather(inputs[:2] + [inputs[2][:1].copy()] + inputs[3:], qt.specs, "float32",
                     "float32", False)
    with pytest.raises(TypeError, match="lhs must be uint32"):
        E.gather(inputs[:-2] + [inputs[-2].astype(np.int32), inputs[-1]], qt.specs,
                     "float32", "float32", False)


# ------------------------------------------------ the tiled kernel (prefill)

def sorted_prefill(rng, tokens, top, E_, k, dt):
    """mlx-lm's sorted SwitchGLU call: x (tokens*top, 1, K) in expert order,
    rhs the sorted expert of each row, lhs defaulted."""
    idx = rng.integers(0, E_, (tokens, top))
    order = np.argsort(idx.reshape(-1), kind="stable")
    x = rand(rng, (tokens, 1, k), dt)[mx.array(order // top)]
    return x, u32(idx.reshape(-1)[order])


@pytest.mark.parametrize("bits,gs", list(itertools.product(BITS, GROUP_SIZES)))
def test_tiled_sorted_prefill_every_width_and_group(bits, gs):
    rng = np.random.default_rng(bits * 100 + gs)
    act = ACTS[(bits + gs // 32) % 3]
    dt = MX_DTYPE[act]
    E_, N, k = 6, int(rng.choice([37, 40])), gs * int(rng.integers(1, 3))
    qt = mlx_stack(rng, E_, N, k, bits, gs, dt)
    seg = qt.segments[0]
    x, rhs = sorted_prefill(rng, 41, 2, E_, k, dt)  # 82 rows: 3 row blocks, runs across them
    y = check(x, qt, None, rhs, sorted_indices=True)
    want = mx.gather_qmm(x, seg.wq, seg.scales, seg.biases, None, rhs, transpose=True,
                         group_size=gs, bits=bits, sorted_indices=True, stream=mx.cpu)
    assert_near_mlx(E.storage_to_f64(y, act), np.array(want.astype(mx.float32), dtype=np.float64),
                    act)


def test_which_kernel_runs():
    """Sorted prefill (>= 64 rows, >= 8 rows per expert on average) and
    M > 8 take the tiled kernel; decode (a few rows), unsorted M = 1, short
    sorted calls and sorted calls spread over many experts (64 pairs over
    128: one or two rows each) the GEMV."""
    assert E.gather_kernel(82, 1, True).startswith("mixbits_gather_qmm_")
    assert E.gather_kernel(82, 1, True, 6).startswith("mixbits_gather_qmm_")
    assert E.gather_kernel(4096, 1, True, 128).startswith("mixbits_gather_qmm_")
    assert E.gather_kernel(4, 11, False).startswith("mixbits_gather_qmm_")
    for pairs, M, srt, wb in [(82, 1, False, 1), (63, 1, True, 1), (8, 1, True, 1),
                              (30, 8, False, 1), (64, 1, True, 128), (82, 1, True, 11)]:
        assert E.gather_kernel(pairs, M, srt, wb).startswith("mixbits_gather_qmv_"), (pairs, M, srt)


@pytest.mark.parametrize("M", [1, 3])
def test_gemv_sorted_runs_over_many_experts(M):
    # Sorted pairs spread over many experts (fewer than 8 rows each) take
    # the GEMV in 8-row blocks: several runs per block, runs across block
    # boundaries, at M = 3 a pair's rows split between two blocks; mixed
    # segments with a perm (one dispatch walking the segment table).
    rng = np.random.default_rng(60 + M)
    qt = mixed_stack(rng, 16, 37, [(4, 64, 128), (3, 32, 96)], mx.float16)
    idx = np.sort(rng.integers(0, 16, 39))
    x = rand(rng, (39, M, 224), mx.float16)
    assert E.gather_kernel(39, M, True, 16).startswith("mixbits_gather_qmv_")
    check(x, qt, None, u32(idx), sorted_indices=True)


# Runs of the sorted GEMV's chained 8-row blocks (a run belongs whole to
# the block it starts in): a run of 5 starting on block 0's last row, runs
# of exactly 8 and 9 rows (one pass, two), a run of 21 pairs that moves
# its block's rhs window (17 rows) once at M = 1 and twice at M = 2, an
# out-of-range lhs inside it, out-of-range experts as a long run at the
# end (64 pairs).
LONG_RUNS = [(0, 3), (1, 4), (2, 5), (3, 8), (4, 9), (5, 21), (6, 1), (7, 2), (9, 1),
             (-1, 10)]


@pytest.mark.parametrize("M", [1, 2])
def test_gemv_sorted_long_runs_across_blocks(M):
    rng = np.random.default_rng(70 + M)
    qt = mixed_stack(rng, 32, 37, [(4, 64, 128), (3, 32, 96)], mx.float16)
    rhs = np.concatenate([np.full(n, e, np.int64) for e, n in LONG_RUNS])
    pairs = len(rhs)
    x = rand(rng, (pairs, M, 224), mx.float16)
    lhs = np.arange(pairs)
    lhs[35] = pairs + 3  # inside expert 5's run
    bad = (lhs >= pairs) | (rhs < 0)
    assert E.gather_kernel(pairs, M, True, 32).startswith("mixbits_gather_qmv_")
    y = E.storage_to_f64(emulate(x, qt, u32(lhs), u32(rhs), sorted_indices=True), "float16")
    assert np.isnan(y[bad]).all() and np.isfinite(y[~bad]).all()
    ok = mx.array(~bad)
    ref, mag = reference(x, qt, mx.where(ok, mx.array(lhs), 0), mx.where(ok, mx.array(rhs), 0))
    assert_close(y[~bad], "float16", ref[~bad], mag[~bad])


def test_gemv_unsorted_indices_flagged_sorted_stays_correct():
    # A caller that claims sorted without sorting: equal neighbours chain
    # into runs anywhere, the same expert comes back in later runs.
    rng = np.random.default_rng(75)
    qt = mixed_stack(rng, 16, 21, [(4, 32, 64)], mx.float32)
    rhs = rng.integers(0, 3, 45)
    x = rand(rng, (45, 1, 64))
    assert E.gather_kernel(45, 1, True, 16).startswith("mixbits_gather_qmv_")
    check(x, qt, None, u32(rhs), sorted_indices=True)


@pytest.mark.parametrize("nseg", [3, 8, 9])
def test_gemv_one_dispatch_per_eight_segments(nseg):
    # The gathered GEMV walks up to 8 segments (each its own width, group
    # and stacked arrays) in one dispatch, accumulating in registers; a
    # ninth costs a second dispatch that adds the float32 partial sum.
    # Unsorted repeated pairs, a perm, M = 2.
    rng = np.random.default_rng(80 + nseg)
    specs = [(b, g, g) for b, g in zip((8, 6, 5, 4, 3, 2, 2, 2, 3),
                                       (32, 64, 128, 32, 64, 128, 32, 32, 64))][:nseg]
    K = sum(k for _, _, k in specs)
    qt = mixed_stack(rng, 5, 21, specs, mx.float16)
    x = rand(rng, (3, 2, K), mx.float16)
    lhs, rhs = u32(rng.integers(0, 3, 7)), u32(rng.integers(0, 5, 7))
    with E.counting() as rec:
        check(x, qt, lhs, rhs)
    assert [r["kernel"] for r in rec] == \
        ["mixbits_gather_qmv_float16_float16"] * (1 if nseg <= 8 else 2)


@pytest.mark.parametrize("nseg", [3, 8, 9])
@pytest.mark.parametrize("act", ["float16", "bfloat16"])
def test_tiled_one_dispatch_per_eight_segments(nseg, act):
    # The tiled kernel walks up to 8 segments (each its own width, group and
    # stacked arrays) in one dispatch, in every run of equal expert of a
    # 32-row block, accumulating in registers; a ninth costs a second
    # dispatch that adds the float32 partial sum. Sorted prefill over 5
    # experts (runs across and inside blocks), a perm.
    rng = np.random.default_rng(90 + nseg)
    specs = [(b, g, g) for b, g in zip((8, 6, 5, 4, 3, 2, 2, 2, 3),
                                       (32, 64, 128, 32, 64, 128, 32, 32, 64))][:nseg]
    K = sum(k for _, _, k in specs)
    qt = mixed_stack(rng, 5, 37, specs, MX_DTYPE[act])
    x, rhs = sorted_prefill(rng, 36, 2, 5, K, MX_DTYPE[act])
    with E.counting() as rec:
        check(x, qt, None, rhs, sorted_indices=True)
    assert [r["kernel"] for r in rec] == \
        [f"mixbits_gather_qmm_{act}_{act}"] * (1 if nseg <= 8 else 2)


def test_gemv_sorted_block_with_bad_indices_gives_nan_rows():
    # An out-of-range rhs (sorted last, as -1 becomes 2^32 - 1) is a run of
    # its own; an out-of-range lhs poisons its rows only, not its run's.
    rng = np.random.default_rng(64)
    qt = mixed_stack(rng, 5, 21, [(4, 32, 64)], mx.float32, perm=False)
    x = rand(rng, (6, 2, 64))
    lhs = mx.array(np.array([0, 1, 7, 2, 3, 4, 5, 0, 1, 2], np.int32))
    rhs = mx.array(np.array([0, 0, 0, 1, 1, 1, 3, 3, -1, -1], np.int32))
    y = E.storage_to_f64(emulate(x, qt, lhs, rhs, sorted_indices=True), "float32")
    bad = np.array([False, False, True, False, False, False, False, False, True, True])
    assert np.isnan(y[bad]).all()
    assert np.isfinite(y[~bad]).all()
    ok = mx.array(~bad)
    ref, mag = reference(x, qt, mx.where(ok, lhs, 0), mx.where(ok, rhs, 0))
    assert_close(y[~bad], "float32", ref[~bad], mag[~bad])


def test_tiled_and_gemv_agree_on_mixed_segments_with_perm():
    rng = np.random.default_rng(31)
    qt = mixed_stack(rng, 5, 33, [(4, 64, 128), (8, 32, 64), (3, 128, 128)], mx.float32)
    x, rhs = sorted_prefill(rng, 50, 2, 5, 320, mx.float32)
    a = E.storage_to_f64(check(x, qt, None, rhs, sorted_indices=True), "float32")
    b = E.storage_to_f64(check(x, qt, None, rhs, sorted_indices=False), "float32")
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-6 * np.abs(b).max())


def test_tiled_with_unsorted_indices_flagged_sorted_stays_correct():
    # A caller that claims sorted without sorting: many runs per block.
    rng = np.random.default_rng(32)
    qt = mlx_stack(rng, 7, 24, 128, 5, 64, mx.float16)
    x = rand(rng, (70, 1, 128), mx.float16)
    check(x, qt, None, u32(rng.integers(0, 7, 70)), sorted_indices=True)


def test_tiled_many_rows_per_matrix_unsorted():
    # M > 8 rows per output matrix takes the tiled kernel whatever the flag.
    rng = np.random.default_rng(33)
    qt = mixed_stack(rng, 3, 19, [(2, 32, 64), (6, 64, 64)], mx.bfloat16)
    check(rand(rng, (4, 11, 128), mx.bfloat16), qt, u32([3, 0, 2, 1, 1]), u32([2, 2, 0, 1, 2]))


@pytest.mark.parametrize("segments", [1, 2])
def test_tiled_bad_indices_give_nan_rows_like_the_cpu(segments):
    rng = np.random.default_rng(34 + segments)
    specs = [(4, 32, 64)] if segments == 1 else [(4, 32, 64), (8, 64, 64)]
    qt = mixed_stack(rng, 4, 21, specs, mx.float32, perm=False)
    K = sum(s[2] for s in specs)
    x = rand(rng, (70, 1, K))
    rhs = np.sort(rng.integers(0, 4, 70)).astype(np.int64)
    lhs = np.arange(70)
    rhs[[5, 33, 34]] = 4          # expert out of range, inside sorted runs
    lhs[[40, 66]] = 70            # x matrix out of range
    y = E.storage_to_f64(emulate(x, qt, u32(lhs), u32(rhs), sorted_indices=True), "float32")
    bad = np.zeros(70, bool)
    bad[[5, 33, 34, 40, 66]] = True
    assert np.isnan(y[bad]).all() and np.isfinite(y[~bad]).all()
    cpu = np.array(mixbits.gather_qmatmul(x, qt, u32(lhs), u32(rhs)))
    np.testing.assert_array_equal(np.isnan(cpu).all(axis=(1, 2)), bad)
    ok = mx.array(~bad)
    ref, mag = reference(x, qt, mx.where(ok, u32(lhs), 0), mx.where(ok, u32(rhs), 0))
    assert_close(y[~bad], "float32", ref[~bad], mag[~bad])
