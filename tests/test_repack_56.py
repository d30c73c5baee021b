"""5- and 6-bit segments in the repacked layout (cpp/qmatmul_int8/repack.h:
four 4-bit low-plane words and one or two high-plane words per chunk of 32
codes). The layout itself and repack/unrepack as exact inverses are in
test_repack.py (split56_model), embedding lookups in
test_repack_embedding.py; here the kernels, forced to each x86 backend:

- the AVX512-VNNI and the AVX2 repacked kernels give the same bits (exact
  integer dots per group, the same float epilogue);
- each is within float rounding of the numpy model of the int8/int16
  contract, and within the contract's documented error bound of float64
  x @ W.T (as test_qmatmul_int8.py checks the original layout);
- each agrees with the original layout's integer path to float rounding
  (not bit for bit: the original layout's kernels sum a group's products
  in another order and fold scales in another place; 2, 3, 4, 8 bits
  differ the same way, test_repack.py);
- the calls that un-repack (float contract, ref backend, M > 16) give the
  original layout's result bit for bit, so merge_planes gives back MLX's
  bitstream.

Planted bugs (each reverted), failing tests of this file (52) /
test_repack.py (159) / test_repack_embedding.py (60): VNNI 5/6-bit high
word shifted by shift 0's amount at every shift 46 / 12 / 0; AVX2 6 bits
reading H0 for every low word 26 / 6 / 0; plane order high words first
(split and merge agreeing, so repack/unrepack still round-trip) 46 / 42 /
18; merge_planes reading the neighbour code's high bits 6 / 18 / 0; x in
the 2-bit word order for 5/6 bits (repacked_x_col) 46 / 24 / 0; Python
lookups with 6-bit high words swapped 0 / 0 / 9; the AVX2 one-row pass
summing 8 steps in int16 at 5 and 6 bits (its limit is 4 and 2) 2 / - / -
(test_largest_partial_sums_do_not_saturate). A high-bit placement
that breaks the one-shift property (e.g. code i's high bits in byte
i % 4) fails to compile (split_hshift_ok).
"""

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from mixbits import _ext, ops
from int_contract import CONTRACTS, contract_model, rand_qt
from reference import OUT_EPS, dequantize_f64, to_f64

X86 = [b for b in ("avx512", "avx2") if b in ops.available_backends()]
pytestmark = pytest.mark.skipif(not X86 or not ops.repacked_kernels_available(),
                                reason="no x86 repacked kernels on this CPU")
SDTYPES = [mx.float32, mx.float16, mx.bfloat16]


@pytest.fixture(params=sorted(CONTRACTS))
def act(request):
    return request.param


def run(x, t, backend, act):
    return to_f64(mixbits.qmatmul(x, t, backend=backend, activations=act))


def check(x, qt, rt, act):
    """Every check of the module docstring for one x; returns the result."""
    x = mx.array(x)
    y_star, _, d, mag2, x64 = contract_model(x, qt, act)
    oute = OUT_EPS[mx.float32]
    w = dequantize_f64(qt)
    y64 = x64 @ w.T
    # |x - d xq| <= d/2 + 2^-22 |x| per element; tiny groups dropped whole
    bound = (d / 2 + 2.0**-22 * np.abs(x64) + (d == 0) * np.abs(x64)) @ np.abs(w).T
    ys = {}
    for b in X86:
        y = run(x, rt, b, act).reshape(y_star.shape)
        np.testing.assert_array_less(np.abs(y - y_star), 4e-6 * mag2 + 2 * oute * np.abs(y_star) + 1e-30,
                                     err_msg=f"{b} vs contract")
        np.testing.assert_array_less(np.abs(y - y64), bound + 4e-6 * mag2 + 2 * oute * np.abs(y64) + 1e-30,
                                     err_msg=f"{b} vs float64 bound")
        y0 = run(x, qt, b, act).reshape(y_star.shape)
        np.testing.assert_array_less(np.abs(y - y0), 8e-6 * mag2 + 4 * oute * np.abs(y0) + 1e-30,
                                     err_msg=f"{b} vs original layout")
        ys[b] = y
    if len(ys) == 2:
        np.testing.assert_array_equal(ys["avx512"], ys["avx2"], err_msg="VNNI vs AVX2 bits")
    return ys[X86[0]]


@pytest.mark.parametrize("bits", [5, 6])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("sdtype", SDTYPES)
def test_kernels_every_group_size_scale_dtype_and_m(bits, gs, sdtype, act):
    rng = np.random.default_rng(bits * 1000 + gs)
    qt = rand_qt(rng, 37, [(bits, gs, 2 * gs)], dtype=sdtype)  # 37: a padded tail block
    rt = ops.repack(qt)
    for M in range(1, 17):  # 9..16: two passes of 8 rows; odd and even
        check(rng.standard_normal((M, qt.shape[1])).astype(np.float32), qt, rt, act)


@pytest.mark.parametrize("bits", [5, 6])
def test_extreme_codes_do_not_saturate(bits, act):
    """Codes 0 and 2^bits - 1 against activations at +-Q: the AVX2 int8
    pair sums (vpmaddubsw into int16) at their largest."""
    rng = np.random.default_rng(bits)
    w = np.where(rng.random((19, 128)) < 0.5, -1.0, 1.0).astype(np.float32)
    qt = mixbits.quantize(mx.array(w), [(bits, 32, 128)])
    rt = ops.repack(qt)
    x = np.where(rng.random((16, 128)) < 0.5, -3.0, 3.0).astype(np.float32)
    for xx in (x, -x[:3], np.abs(x[:5])):
        check(xx, qt, rt, act)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("gs", [32, 128])
def test_largest_partial_sums_do_not_saturate(bits, gs, act):
    """Every code but each group's first at the top, against x at +Q or
    -Q everywhere: each int16 sum of the AVX2 kernels (vpmaddubsw's pairs,
    and the sums of several steps before vpmaddwd: every int8 pass sums
    steps, and the passes of 2-4 rows at 2, 4 and 8 bits (its nibbles) sum
    across words of a group) at its largest, in every lane. (Random signs
    rarely line a whole sum up.) 1 to 6 x rows: the one-row pass, and
    passes of two, three, four rows, and 3 + 3."""
    w = -np.ones((37, 256), np.float32)
    w[:, ::gs] = 1.0  # MLX's quantize maps each group's max to code 0, the -1s to the top code
    qt = mixbits.quantize(mx.array(w), [(bits, gs, 256)])
    seg = qt.segments[0]
    groups = lambda a: np.repeat(np.array(a, np.float64), gs, axis=1)
    codes = np.rint((dequantize_f64(qt) - groups(seg.biases)) / groups(seg.scales))
    top = np.ones(256, bool)
    top[::gs] = False
    assert (codes[:, top] >= 2**bits - 2).all()  # the top code (2^bits - 2 where MLX keeps one spare)
    rt = ops.repack(qt)
    x = np.full((1, 256), 3.0, np.float32)
    for xx in (x, -x, np.concatenate([x, -x]), np.concatenate([x, -x, x]),
               np.concatenate([x, -x] * 2), np.concatenate([x, -x] * 3)):
        check(xx, qt, rt, act)


@pytest.mark.parametrize("sdtype", SDTYPES)
def test_mixed_segments_with_perm(sdtype, act):
    rng = np.random.default_rng(56)
    segs = [(5, 32, 64), (4, 64, 128), (6, 128, 256), (3, 32, 96), (8, 64, 64), (6, 32, 32),
            (2, 128, 128), (5, 128, 128)]
    qt = rand_qt(rng, 45, segs, perm=True, dtype=sdtype)
    rt = ops.repack(qt)
    for M in (1, 2, 7, 8, 13):
        check(rng.standard_normal((M, qt.shape[1])).astype(np.float32), qt, rt, act)


@pytest.mark.parametrize("backend", [b for b in ops.available_backends() if b != "neon"])
def test_unrepacking_paths_give_the_original_bits(backend, act):
    rng = np.random.default_rng(65)
    qt = rand_qt(rng, 21, [(5, 64, 128), (6, 32, 96), (4, 32, 64), (6, 128, 128), (5, 32, 32)],
                 perm=True)
    rt = ops.repack(qt)
    for M, a in ((1, "float"), (5, "float"), (17, act), (17, "float"), (3, act)):
        if a != "float" and backend != "ref" and M <= 16:
            continue  # the repacked kernels (above)
        x = mx.array(rng.standard_normal((M, qt.shape[1])).astype(np.float32))
        want = np.array(mixbits.qmatmul(x, qt, backend=backend, activations=a))
        got = np.array(mixbits.qmatmul(x, rt, backend=backend, activations=a))
        if M > 16 and _ext.repacked_float_min_m(ops._backend_id(backend)) is not None:
            # Not un-repacked above 16 rows: the x86 panels read the
            # blocks (bit for bit the original layout's panels:
            # test_repack_float); on AVX-512 MLX's layout takes its small-M
            # kernels here, another summation order.
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                       err_msg=f"{backend} {a} M={M}")
            continue
        np.testing.assert_array_equal(got, want, err_msg=f"{backend} {a} M={M}")
