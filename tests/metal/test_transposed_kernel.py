"""The transposed quantized matmul's Metal kernels (metal/qmatmul_t.metal:
dx = dy · W un-permuted, MixedQMatmulT's eval_gpu), run unchanged on the
SIMT emulator with the primitive's own inputs.

mixbits._ext.qmatmul_t_node builds the node as the gradient does (every
input dense) on the CPU and returns its name, the arrays it is given and its
output; those arrays, byte for byte, go to the emulator, whose harness checks
their sizes against the launch plan eval_gpu uses (metal/qmatmul_t_host.h).
The results are compared with float64 numpy, with the CPU primitive's output
(its kernels, its un-permutation rules) and with mx.dequantize + matmul."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

import metal_emu as E
import mixbits
from mixbits import _ext
# emulator: the autouse fixture that builds the emulator (or skips), shared
from test_metal_kernels import (ACT_OF, ACTS, BITS, GROUP_SIZES, MX_DTYPE, OUT_EPS,  # noqa: F401
                                assert_close, assert_near_mlx, emulator, rand, to_storage)

# ---------------------------------------------------------------- helpers

def quantized(rng, N, specs, dtype, perm=True):
    k = sum(s[2] for s in specs)
    return mixbits.quantize(rand(rng, (N, k)), specs,
                            perm=rng.permutation(k) if perm else None, dtype=dtype)


def node(dy, perm, qt):
    """MixedQMatmulT's name, inputs (numpy storage) and CPU output."""
    name, inputs, y = _ext.qmatmul_t_node(dy, perm, qt.arrays(), qt.specs)
    assert name == "MixedQMatmulT"
    mx.eval(inputs, y)
    return [to_storage(a) for a in inputs], y


def emulate(dy, qt, perm="qt", order="shuffle", seed=1):
    """(emulator storage, CPU primitive's output) for the same node."""
    perm = qt.perm if isinstance(perm, str) else perm
    inputs, cpu = node(dy, perm, qt)
    act = ACT_OF[dy.dtype]
    got = E.qmv_t(inputs, qt.specs, act, ACT_OF[qt.dtype], perm is not None,
                  order=order, seed=seed)
    assert got.dtype == E.storage_dtype(act)
    return got, cpu


def dense_w(qt):
    """float64 W [N, K] in packed column order, from mx.dequantize."""
    return np.concatenate([np.array(mx.dequantize(s.wq, s.scales.astype(mx.float32),
                                                  s.biases.astype(mx.float32),
                                                  group_size=s.group_size, bits=s.bits),
                                    dtype=np.float64) for s in qt.segments], axis=-1)


def reference(dy, qt):
    """float64 dx = dy · W un-permuted, and sum |dy||W| (same order)."""
    W = dense_w(qt)
    d = np.array(dy.astype(mx.float32), dtype=np.float64).reshape(-1, W.shape[0])
    z, mag = d @ W, np.abs(d) @ np.abs(W)
    if qt.perm is not None:
        p = np.array(qt.perm)
        dx, m = np.empty_like(z), np.empty_like(mag)
        dx[:, p], m[:, p] = z, mag
        z, mag = dx, m
    shape = tuple(dy.shape[:-1]) + (W.shape[1],)
    return z.reshape(shape), mag.reshape(shape)


def check(dy, qt, order="shuffle", seed=1):
    got, cpu = emulate(dy, qt, order=order, seed=seed)
    act = ACT_OF[dy.dtype]
    ref, mag = reference(dy, qt)
    assert_close(got, act, ref, mag)
    # The CPU primitive on the same node: both round once to dy's dtype.
    c = E.storage_to_f64(to_storage(cpu), act)
    g = E.storage_to_f64(got, act)
    np.testing.assert_allclose(g, c, rtol=4 * OUT_EPS[act], atol=1e-4 * float(np.abs(c).max()))
    return g


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("bits,gs", list(itertools.product(BITS, GROUP_SIZES)))
@pytest.mark.parametrize("act", ACTS)
def test_every_width_group_and_dtype(bits, gs, act):
    rng = np.random.default_rng(bits * 1000 + gs + 7 * ACTS.index(act))
    dt = MX_DTYPE[act]
    N = int(rng.choice([5, 13, 21]))  # partial 8-row slices
    k = 256 + gs                      # 3 column blocks, the last partial
    qt = quantized(rng, N, [(bits, gs, k)], dt, perm=True)
    M = int(rng.choice([1, 3]))
    dy = rand(rng, (M, N), dt)
    got = check(dy, qt, seed=int(rng.integers(1 << 30)))
    # And MLX's own dequantize + matmul, un-permuted by numpy.
    s = qt.segments[0]
    W = mx.dequantize(s.wq, s.scales, s.biases, group_size=gs, bits=bits)
    want = np.array(mx.matmul(dy, W.astype(dt), stream=mx.cpu).astype(mx.float32), np.float64)
    dx = np.empty_like(want)
    dx[:, np.array(qt.perm)] = want
    assert_near_mlx(got, dx, act)


@pytest.mark.parametrize("M", [1, 3, 9])
@pytest.mark.parametrize("act", ACTS)
def test_mixed_segments_with_perm_and_batch_dims(M, act):
    # Segment columns 128 | 64 | 96 | 640 | 32 | 128: blocks that start
    # mid-way through K, segments shorter than a block, N = 11 rows.
    rng = np.random.default_rng(100 + M + 10 * ACTS.index(act))
    specs = [(8, 128, 128), (6, 64, 64), (5, 32, 96), (4, 64, 640), (3, 32, 32), (2, 128, 128)]
    qt = quantized(rng, 11, specs, MX_DTYPE[act])
    dy = rand(rng, (2, M, 11), MX_DTYPE[act])
    got = check(dy, qt, seed=M)
    assert got.shape == (2, M, 1088)


@pytest.mark.parametrize("act,scale_act", [(a, s) for a in ACTS for s in ACTS if a != s])
def test_scale_dtype_differs_from_dy(act, scale_act):
    rng = np.random.default_rng(5 + ACTS.index(act) + 3 * ACTS.index(scale_act))
    qt = quantized(rng, 9, [(5, 64, 128), (3, 32, 96)], MX_DTYPE[scale_act])
    check(rand(rng, (2, 9), MX_DTYPE[act]), qt)


def test_no_permutation_writes_dx_directly():
    rng = np.random.default_rng(31)
    qt = quantized(rng, 37, [(4, 32, 160), (6, 128, 256)], mx.float16, perm=False)
    assert qt.perm is None
    check(rand(rng, (3, 37), mx.float16), qt)


def test_long_n_and_k():
    # N over many 8-row slices, K over 17 column blocks.
    rng = np.random.default_rng(32)
    qt = quantized(rng, 301, [(4, 64, 2048), (8, 32, 64)], mx.float32)
    check(rand(rng, (1, 301)), qt)


@pytest.mark.parametrize("M,N,specs,perm,sets", [
    (1, 37, [(3, 32, 512), (6, 64, 512)], False, 1),
    (4, 37, [(3, 32, 512), (6, 64, 512)], False, 2),
    (3, 37, [(3, 32, 512), (6, 64, 512)], True, 4),
    (8, 37, [(5, 32, 256), (2, 128, 512), (8, 64, 256)], True, 4),
    (8, 37, [(4, 64, 2048), (8, 32, 64)], False, 4),
    (6, 300, [(4, 64, 512), (5, 32, 512)], True, 4),
])
def test_wide_blocks_every_set_count(M, N, specs, perm, sets):
    # The host widens a threadgroup to 2 or 4 sets of 128 columns when dy's
    # (and perm's) re-reads per threadgroup would pass 1/16 of W's bytes
    # (qt_sets): one block then spans several column sets, whose partial
    # sums meet in threadgroup memory; segments narrower than the block
    # leave sets idle. N = 37: a partial last 4-row slice in one stage of
    # dy; N = 300: two stages (256 rows each), the second partial.
    rng = np.random.default_rng(40 + 7 * M + sets)
    qt = quantized(rng, N, specs, mx.float16, perm=perm)
    dy = rand(rng, (M, N), mx.float16)
    with E.counting() as rec:
        check(dy, qt, seed=M)
    assert [r["group"][0] for r in rec] == [64 * sets]


class _Perm:
    """A QuantizedTensor with a perm it would refuse (the builder checks
    only its shape and dtype)."""

    def __init__(self, qt, perm):
        self.perm, self.specs, self.dtype, self.arrays = perm, qt.specs, qt.dtype, qt.arrays
        self.segments = qt.segments


@pytest.mark.parametrize("dtype", [np.int32, np.uint32])
def test_out_of_range_entry_poisons_every_row_like_the_cpu(dtype):
    rng = np.random.default_rng(33)
    qt = quantized(rng, 6, [(4, 32, 64), (2, 32, 32)], mx.float32)
    perm = np.array(qt.perm).astype(np.int64)
    perm[17] = 96 if dtype == np.int32 else 2**32 - 1  # -1 as uint32: >= 2^31
    bad = _Perm(qt, mx.array(perm.astype(dtype)))
    got, cpu = emulate(rand(rng, (3, 6)), bad, perm=bad.perm)
    assert np.isnan(got).all()
    assert np.isnan(np.array(cpu)).all()


def test_repeated_entries_sum_like_the_cpu():
    # Two k map to one column (they sum, rounded once), one column gets none
    # (0): the CPU primitive's scatter-add.
    rng = np.random.default_rng(34)
    qt = quantized(rng, 7, [(4, 32, 64), (5, 64, 64)], mx.bfloat16)
    perm = np.array(qt.perm)
    lost = perm[40]
    perm[40] = perm[3]
    bad = _Perm(qt, mx.array(perm))
    dy = rand(rng, (2, 7), mx.bfloat16)
    with E.counting() as rec:
        got, cpu = emulate(dy, bad, perm=bad.perm)
    # The column-by-column path loads W by 4-byte words too (was bytes).
    assert [r["device_read_by_width"]["1"] for r in rec] == [0]
    assert rec[0]["device_read_by_width"]["4"] > 0
    g = E.storage_to_f64(got, "bfloat16")
    z = np.array(dy.astype(mx.float32), np.float64) @ dense_w(qt)
    want = np.zeros_like(z)
    np.add.at(want, (slice(None), perm), z)
    assert (g[:, lost] == 0).all()
    np.testing.assert_allclose(g, want, rtol=2 * OUT_EPS["bfloat16"], atol=1e-3)
    c = E.storage_to_f64(to_storage(cpu), "bfloat16")
    np.testing.assert_allclose(g, c, rtol=4 * OUT_EPS["bfloat16"], atol=1e-3)


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_thread_orders(order):
    rng = np.random.default_rng(35)
    qt = quantized(rng, 13, [(3, 32, 96), (5, 64, 192)], mx.bfloat16)
    check(rand(rng, (3, 13), mx.bfloat16), qt, order=order)


def test_harness_refuses_buffers_the_primitive_would_not_pass():
    # Half the scales where the node holds N rows of them: the launch
    # (planned from dy's and wq's shapes, as eval_gpu plans it) binds them
    # all, so the harness refuses instead of running on a re-layout.
    rng = np.random.default_rng(36)
    qt = quantized(rng, 8, [(4, 32, 64)], mx.float32)
    inputs, _ = node(rand(rng, (1, 8)), qt.perm, qt)
    with pytest.raises(E.EmulatorError, match=r"scales \(buffer 4, float32\[16\]\)"):
        E.qmv_t(inputs[:3] + [inputs[3][:4].copy()] + inputs[4:], qt.specs, "float32",
                "float32", True)



def test_plan_refuses_what_qmv_t_gpu_applies_refuses():
    # One dispatch binds every segment (8 slots) and checks the perm in a
    # K-bit map (K <= 65536): past either, qmv_t_gpu_applies sends the
    # gradient to dequantize + matmul, and the plan itself refuses.
    rng = np.random.default_rng(37)
    qt = quantized(rng, 4, [(4, 32, 32)] * 9, mx.float32)
    inputs, _ = node(rand(rng, (1, 4)), qt.perm, qt)
    with pytest.raises(E.EmulatorError, match="more than 8 segments"):
        E.qmv_t(inputs, qt.specs, "float32", "float32", True)
    qt = quantized(rng, 1, [(2, 128, 65536 + 128)], mx.float32, perm=False)
    inputs, _ = node(rand(rng, (1, 1)), None, qt)
    with pytest.raises(E.EmulatorError, match="K past MB_QT_MAX_K"):
        E.qmv_t(inputs, qt.specs, "float32", "float32", False)
