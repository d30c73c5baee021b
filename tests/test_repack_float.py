"""The float contract on repacked weights (issue 16, prefill): calls with
more rows than the small-M kernels take read the row-interleaved blocks in
place on AVX-512 and AVX2 (cpp/qmatmul/avx2_panel_r.cpp packs the prefill
GEMM's panels from them) and must give bit for bit what the same kernel gives on
MLX's layout of the same weight, and the float64 reference (numpy of
mx.dequantize) to float32 accumulation. Calls the in-place reader does not
take (fewer rows, other backends) un-repack W: compared the same way."""

import platform

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from mixbits import _ext, ops
from mixbits.repack import REPACK_BITS
from cpu_flags import cpu_flags
from int_contract import poison_padding, rand_qt
from reference import assert_matmul_close, qmatmul_f64

HAVE = ops.available_backends()
# 17, 33: fewer rows than the AVX-512 float row's small-M kernels take (on
# MLX's layout); 41 the first row count its panels take; 64 a prompt; 130:
# two panels of x rows plus a tail. On x86 a repacked weight takes the
# panels from 17 rows on (16 and fewer: the integer kernels, or under the
# float contract its un-repacked W, the original layout's bits).
MS = (17, 33, 41, 64, 130)
BACKENDS = ["auto"] + [b for b in ("avx2", "avx512") if b in HAVE]


def min_m(backend):
    return _ext.repacked_float_min_m(ops._backend_id(backend))


def test_the_in_place_reader_is_what_this_machine_runs():
    """The bitwise tests below reach the packers only where a row has them
    (AVX-512 and AVX2), above the integer contracts' 16 rows: on this x86
    host they must."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    if "avx2" not in cpu_flags():
        pytest.skip("no AVX2 on this CPU")
    rows = ["auto", "avx2"] + (["avx512"] if "avx512f" in cpu_flags() else [])
    for b in rows:
        assert min_m(b) == 16, b
    assert min_m("ref") is None
    # ... for every width the layout has (a weight with a width it lacks
    # would silently take the un-repack path instead).
    for b in rows:
        assert _ext.repacked_float_bits(ops._backend_id(b)) == list(REPACK_BITS)
    assert _ext.repacked_float_bits(ops._backend_id("ref")) == []
    assert min(MS) <= 40 < max(MS)  # both regimes of the original layout


# Each float row's small_m (avx2_table.h): on MLX's layout, calls of more
# rows take the panels, which the repacked layout takes at every M.
PANEL_ROWS = {"avx512": 40, "avx2": 10}


def panel_rows(backend):
    row = backend if backend != "auto" else next(b for b in ("avx512", "avx2") if b in HAVE)
    return PANEL_ROWS[row]


def check(x, qt, rt, backend, act="float"):
    """Repacked == original layout bit for bit where both run the same
    kernel (the panels; or, without an in-place reader, the same kernel on
    un-repacked W), and both near float64."""
    want = mixbits.qmatmul(x, qt, backend=backend, activations=act)
    got = mixbits.qmatmul(x, rt, backend=backend, activations=act)
    assert got.dtype == want.dtype and got.shape == want.shape
    ref, mag = qmatmul_f64(x, qt)
    assert_matmul_close(got, ref, mag)
    rows = int(np.prod(x.shape[:-1]))
    if min_m(backend) is not None and rows <= panel_rows(backend):
        assert_matmul_close(want, ref, mag)  # another summation order, same contract
        return
    a, b = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    bad = (a != b) & ~(np.isnan(a) & np.isnan(b))
    assert not bad.any(), (f"{bad.sum()} of {bad.size} outputs differ from the original layout "
                           f"(M={x.shape[-2]}, {backend}); first at {np.argwhere(bad)[0]}")


@pytest.mark.parametrize("bits", REPACK_BITS)
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("sdtype", [mx.float32, mx.float16, mx.bfloat16])
def test_one_segment_bitwise(bits, gs, sdtype):
    # N = 101: 6 blocks + 5 rows (padding), 2 panels of 48 + a 5-row one;
    # K = 1280: kc blocks of 512, 512 and 256 columns.
    rng = np.random.default_rng(bits * 1000 + gs)
    qt = rand_qt(rng, 101, [(bits, gs, 1280)], dtype=sdtype)
    rt = ops.repack(qt)
    for M in MS:
        x = mx.array(rng.standard_normal((M, 1280)).astype(np.float32))
        for backend in BACKENDS:
            check(x, qt, rt, backend)


@pytest.mark.parametrize("x_dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("act", ["float", "int8", "int16"])
def test_mixed_segments_with_perm(x_dtype, act):
    """Every bit width in one weight, segments not aligned to kc blocks, a
    permutation, 3-D x in each float dtype; the integer contracts take the
    float path above 16 rows. N = 200: two tiles of the driver (192 rows)."""
    rng = np.random.default_rng(21)
    segs = [(8, 32, 64), (4, 64, 1088), (3, 128, 256), (2, 128, 256), (2, 32, 96),
            (3, 32, 608), (8, 128, 128)]
    qt = rand_qt(rng, 200, segs, perm=True, dtype=mx.bfloat16 if x_dtype == mx.float32 else x_dtype)
    rt = ops.repack(qt)
    K = qt.shape[1]
    for M in (33, 64):  # x rows per batch element: 66 and 128 in all
        x = mx.array(rng.standard_normal((2, M, K)).astype(np.float32)).astype(x_dtype)
        for backend in BACKENDS:
            check(x, qt, rt, backend, act)


def test_threads_do_not_change_the_result():
    rng = np.random.default_rng(22)
    qt = rand_qt(rng, 301, [(4, 64, 512), (2, 32, 256), (3, 64, 256), (8, 32, 128)])
    rt = ops.repack(qt)
    x = mx.array(rng.standard_normal((70, 1152)).astype(np.float32))
    old = _ext.max_threads()
    try:
        _ext.set_max_threads(2)
        a = np.array(mixbits.qmatmul(x, rt))
        _ext.set_max_threads(1)
        b = np.array(mixbits.qmatmul(x, rt))
        want = np.array(mixbits.qmatmul(x, qt))
    finally:
        _ext.set_max_threads(old)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(b, want)


def test_padding_rows_never_reach_the_output():
    """Garbage in the last block's padding rows (zeros as built) changes
    nothing: the panels' lanes past N are never stored."""
    rng = np.random.default_rng(23)
    qt = rand_qt(rng, 21, [(4, 64, 256), (2, 32, 64), (3, 32, 64), (8, 32, 64)])
    dirty = poison_padding(rng, ops.repack(qt), scale=1e30)
    x = mx.array(rng.standard_normal((64, 448)).astype(np.float32))
    np.testing.assert_array_equal(np.array(mixbits.qmatmul(x, dirty)),
                                  np.array(mixbits.qmatmul(x, qt)))


def test_sibling_group_node():
    """The grouped node (a layer's q/k/v at prefill) takes the same path."""
    rng = np.random.default_rng(24)
    qts = [rand_qt(rng, n, [(b, 64, 576)]) for n, b in ((64, 4), (37, 3), (80, 2), (48, 8))]
    rts = [ops.repack(q) for q in qts]
    x = mx.array(rng.standard_normal((64, 576)).astype(np.float32))
    outs = _ext.repacked_qmatmul_group(x, [(r.arrays(), r.specs, r.shape[0]) for r in rts], 0, 0)
    for y, qt in zip(outs, qts):
        np.testing.assert_array_equal(np.array(y), np.array(mixbits.qmatmul(x, qt)))
