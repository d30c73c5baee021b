"""The repacked layout's arm64 kernels (cpp/qmatmul_int8/neon_repacked.cpp),
built for aarch64 with and without the dot-product extension and run under
qemu-user (tests/neon/repacked_harness.cpp) through the driver an aarch64
build runs (repacked_run.cpp), on the real wq_r / scales_r / biases_r that
this machine's repack_segment builds: against the numpy model of the
int8/int16 contract (int_contract.py, codes from mx.dequantize of the
original layout) and against this machine's x86 repacked kernels. qemu
checks results, not speed.

Planted bugs in neon_repacked.cpp (each reverted), tests of this file
failing out of 14 (before 5/6 bits): x lane order reversed (add<3 - t % 4>) 14; the 3-bit
high-bit shift of half 0 used for half 1 too 10 (the 8-bit extremes pass);
the 8-bit c - 128 correction dropped 7 (every int8 test); padding rows
stored 4 (the poisoned-padding tests); the armv8 int8 product of rows
4q+2, 4q+3 using rows 4q, 4q+1's codes 3 (armv8 int8 only); the same in
the int16 accumulator 7 (every int16 test). With 5/6 bits, out of 22:
the 5/6-bit high word shifted by shift 0's amount at every shift 18; 6
bits reading H0 for every low word 14; x in the 2-bit word order for 5/6
bits (repacked_x_col) 16."""

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from mixbits import ops
from neon_emulator import BASE_ARCH_FLAGS, REPACKED_SOURCES, build, run_repacked
from int_contract import contract_model, rand_qt
from reference import OUT_EPS

SDTYPES = [mx.float16, mx.bfloat16, mx.float32]


@pytest.fixture(scope="module")
def harness_dotprod(tmp_path_factory):
    return build(tmp_path_factory.mktemp("rp_dot") / "repacked_harness", REPACKED_SOURCES)


@pytest.fixture(scope="module")
def harness_armv8(tmp_path_factory):
    return build(tmp_path_factory.mktemp("rp_v8") / "repacked_harness", REPACKED_SOURCES,
                 arch=BASE_ARCH_FLAGS)


@pytest.fixture(params=["dotprod", "armv8"])
def harness(request):
    return request.getfixturevalue("harness_" + request.param)


def contract_tol(y_star, mag2):
    """Float rounding of the kernels' partial sums (test_qmatmul_int8.py)."""
    return 4e-6 * mag2 + 2 * OUT_EPS[mx.float32] * np.abs(y_star) + 1e-30


def check(got, x, qt, act, what):
    y_star, _, _, mag2, _ = contract_model(mx.array(x), qt, act)
    err, tol = np.abs(got - y_star), contract_tol(y_star, mag2)
    bad = ~(err <= tol)  # NaN counts as bad
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} off; first at {i}: "
                             f"got {got[i]}, want {y_star[i]}, tol {tol[i]}")


def single_segment_cases(rng):
    """Every repacked width and group size, N with and without padding
    rows, every M of the integer path (1..16) and every scale dtype."""
    cases, i = [], 0
    for bits in (2, 3, 4, 5, 6, 8):
        for gs in (32, 64, 128):
            n = int(rng.choice([1, 5, 16, 17, 33, 48]))
            qt = rand_qt(rng, n, [(bits, gs, gs * int(rng.integers(1, 4)))], dtype=SDTYPES[i % 3])
            x = rng.standard_normal((1 + i % 16, qt.shape[1])).astype(np.float32)
            cases.append((x, qt))
            i += 5  # 5 and 16 coprime: M runs through 1..16 over the 18 cases
    return cases


def mixed_cases(rng):
    """Mixed segments, one of each width, in one row (the driver runs them
    per segment into the same y)."""
    out = []
    for n, m, dt in ((29, 11, mx.float16), (64, 16, mx.bfloat16), (7, 1, mx.float32)):
        qt = rand_qt(rng, n, [(8, 32, 64), (3, 128, 128), (2, 64, 128), (4, 32, 96)], dtype=dt)
        out.append((rng.standard_normal((m, qt.shape[1])).astype(np.float32), qt))
    for n, m, dt in ((37, 5, mx.bfloat16), (16, 8, mx.float32), (3, 13, mx.float16)):
        qt = rand_qt(rng, n, [(5, 32, 64), (4, 64, 64), (6, 128, 128), (3, 32, 32), (6, 32, 96),
                              (5, 128, 128)], dtype=dt)
        out.append((rng.standard_normal((m, qt.shape[1])).astype(np.float32), qt))
    return out


@pytest.mark.parametrize("act", ["int8", "int16"])
def test_kernels_compute_the_contract(harness, tmp_path, act):
    rng = np.random.default_rng(21)
    cases = single_segment_cases(rng) + mixed_cases(rng)
    outs = run_repacked(harness, tmp_path, [(act, x, ops.repack(qt), False) for x, qt in cases],
                        threads=2)
    for (x, qt), got in zip(cases, outs):
        specs = [(s.bits, s.group_size, s.k) for s in qt.segments]
        check(got, x, qt, act, f"{act} {specs} N={qt.shape[0]} M={x.shape[0]}")


@pytest.mark.parametrize("bits", [8, 6, 5])
@pytest.mark.parametrize("act", ["int8", "int16"])
def test_extreme_codes(harness, tmp_path, act, bits):
    """Codes 0 and 2^bits - 1 (8 bits: the int8 kernels' c - 128 offset at
    both ends; 5, 6: both planes' bits all set) with activations at +-Q: a
    lost 128·ix, a lost high bit or a saturating product shows here."""
    rng = np.random.default_rng(5)
    n, k = 19, 128
    w = np.where(rng.random((n, k)) < 0.5, -1.0, 1.0).astype(np.float32)  # codes 0 and max
    qt = mixbits.quantize(mx.array(w), [(bits, 32, k)])
    x = np.where(rng.random((16, k)) < 0.5, -3.0, 3.0).astype(np.float32)  # every |xq| = Q
    cases = [(x, qt), (-x[:3], qt), (np.abs(x[:5]), qt)]
    outs = run_repacked(harness, tmp_path, [(act, x, ops.repack(qt), False) for x, qt in cases])
    for (x, qt), got in zip(cases, outs):
        check(got, x, qt, act, f"{act} {bits}-bit extremes M={x.shape[0]}")


@pytest.mark.parametrize("act", ["int8", "int16"])
def test_padding_rows_are_never_stored(harness, tmp_path, act):
    """The harness fills the last block's padding rows with nonzero codes,
    scales and biases: a kernel that stores them changes the next x row's
    first outputs or writes into the guard after y (the harness then exits
    4), either of which fails here."""
    rng = np.random.default_rng(9)
    cases = []
    for n in (1, 5, 21, 47):
        qt = rand_qt(rng, n, [(4, 64, 128), (8, 32, 64), (3, 32, 64), (2, 128, 128), (5, 32, 64),
                              (6, 64, 64)])
        x = rng.standard_normal((int(rng.integers(2, 17)), qt.shape[1])).astype(np.float32)
        cases.append((x, qt))
    outs = run_repacked(harness, tmp_path, [(act, x, ops.repack(qt), True) for x, qt in cases])
    for (x, qt), got in zip(cases, outs):
        check(got, x, qt, act, f"{act} poisoned padding N={qt.shape[0]} M={x.shape[0]}")


@pytest.mark.parametrize("act", ["int8", "int16"])
def test_neon_agrees_with_the_x86_repacked_kernels(harness_dotprod, tmp_path, act):
    """Both ISAs run the same consumption order and epilogue on the same
    bytes: the results agree to float rounding (this machine's auto
    backend: VNNI, else AVX2)."""
    if not ops.repacked_kernels_available():
        pytest.skip("no x86 repacked kernels on this CPU")
    rng = np.random.default_rng(4)
    cases = mixed_cases(rng)
    rts = [ops.repack(qt) for _, qt in cases]
    outs = run_repacked(harness_dotprod, tmp_path,
                        [(act, x, rt, False) for (x, _), rt in zip(cases, rts)])
    for (x, qt), rt, got in zip(cases, rts, outs):
        want = np.array(mixbits.qmatmul(mx.array(x), rt, activations=act), np.float64)
        y_star, _, _, mag2, _ = contract_model(mx.array(x), qt, act)
        np.testing.assert_array_less(np.abs(got - want), 2 * contract_tol(y_star, mag2))
