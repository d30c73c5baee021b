"""The quantized matmul's aarch64 kernels (the CPU path of a Mac), built
for aarch64 and run under qemu-user on the real packed buffers of
mixbits.quantize (tests/neon/qmm_harness.cpp, neon_emulator.py): the float
kernel against float64 x @ W.T from MLX's own dequantize; the integer
contracts against the numpy model of test_qmatmul_int8 and the scalar
reference of the same build; the transposed product against float64."""

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from neon_emulator import BASE_ARCH_FLAGS, QMM_SOURCES, build, run_qmm
from reference import OUT_EPS, dequantize_f64
from int_contract import contract_model as model

SDTYPES = [mx.float32, mx.float16, mx.bfloat16]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return build(tmp_path_factory.mktemp("neon") / "qmm_harness", QMM_SOURCES)


def rand_case(rng, n, segs, dtype, m, scale=1.0):
    K = sum(k for _, _, k in segs)
    w = mx.array(rng.standard_normal((n, K)).astype(np.float32)).astype(dtype)
    qt = mixbits.quantize(w, segs)
    x = (rng.standard_normal((m, K)) * scale).astype(np.float32)
    return x, qt


def assert_close(got, ref, mag, what, rtol=2e-5):
    """|got - ref| <= rtol * sum|x||w| (float32 accumulation) + output rounding."""
    assert got.shape == ref.shape, what
    tol = rtol * mag + 2 * OUT_EPS[mx.float32] * np.abs(ref) + 1e-30
    bad = ~(np.abs(got - ref) <= tol)  # NaN counts as bad
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} off; first at {i}: "
                             f"got {got[i]}, want {ref[i]}, tol {tol[i]}")


def float_cases(rng):
    cases = []
    for bits in (2, 3, 4, 5, 6, 8):
        for gs in (32, 64, 128):
            for dtype in SDTYPES:
                n = int(rng.choice([1, 3, 16, 37]))
                m = int(rng.choice([1, 2, 5, 8, 17]))
                k = gs * int(rng.integers(1, 4))
                cases.append(rand_case(rng, n, [(bits, gs, k)], dtype, m))
    # mixed segments: every width in one row, odd N
    cases.append(rand_case(rng, 29, [(8, 32, 64), (2, 128, 256), (3, 64, 192), (5, 32, 96),
                                     (4, 64, 128), (6, 128, 128)], mx.float16, 3))
    return cases


@pytest.mark.parametrize("threads", [1, 2])
def test_float_kernel_matches_float64(harness, tmp_path, threads):
    rng = np.random.default_rng(threads)
    cases = float_cases(rng)
    outs = run_qmm(harness, tmp_path, [(0, x, qt) for x, qt in cases], ["ref", "neon"], threads)
    for (x, qt), out in zip(cases, outs):
        w = dequantize_f64(qt)
        ref, mag = x.astype(np.float64) @ w.T, np.abs(x.astype(np.float64)) @ np.abs(w).T
        what = f"{[(s.bits, s.group_size, s.k) for s in qt.segments]} {qt.segments[0].scales.dtype} M={x.shape[0]}"
        for name in ("ref", "neon"):
            assert_close(out[name], ref, mag, f"{name} {what}")


def test_float_kernel_edges(harness, tmp_path):
    """Zero x, a large dynamic range, one column group, N = 1."""
    rng = np.random.default_rng(7)
    cases = [rand_case(rng, 5, [(4, 32, 32)], mx.float16, 2, scale=0.0),
             rand_case(rng, 1, [(3, 128, 384)], mx.bfloat16, 1, scale=1e4),
             rand_case(rng, 9, [(2, 32, 32)], mx.float32, 4, scale=1e-6)]
    outs = run_qmm(harness, tmp_path, [(0, x, qt) for x, qt in cases], ["neon"])
    for (x, qt), out in zip(cases, outs):
        w = dequantize_f64(qt)
        assert_close(out["neon"], x.astype(np.float64) @ w.T,
                     np.abs(x.astype(np.float64)) @ np.abs(w).T, "edge")


@pytest.fixture(scope="module")
def harness_armv8(tmp_path_factory):
    return build(tmp_path_factory.mktemp("neon8") / "qmm_harness", QMM_SOURCES, arch=BASE_ARCH_FLAGS)


@pytest.mark.parametrize("act", ["int8", "int16"])
@pytest.mark.parametrize("dotprod", [True, False])
def test_integer_contracts(request, tmp_path, act, dotprod):
    """What an aarch64 build runs for activations=act equals the contract,
    with and without the dot-product extension."""
    harness = request.getfixturevalue("harness" if dotprod else "harness_armv8")
    rng = np.random.default_rng(3)
    cases = []
    for bits in (2, 3, 4, 5, 6, 8):
        for gs in (32, 64, 128):
            cases.append(rand_case(rng, int(rng.choice([1, 7, 33])), [(bits, gs, 2 * gs)],
                                   SDTYPES[bits % 3], int(rng.choice([1, 3, 8, 16]))))
    cases.append(rand_case(rng, 13, [(8, 32, 64), (2, 128, 128), (5, 64, 64)], mx.float16, 5))
    outs = run_qmm(harness, tmp_path, [(0, x, qt) for x, qt in cases], [f"{act}_ref", act])
    for (x, qt), out in zip(cases, outs):
        y_star, _, _, mag2, _ = model(mx.array(x), qt, act)
        for name in (f"{act}_ref", act):
            np.testing.assert_array_less(np.abs(out[name] - y_star),
                                         4e-6 * mag2 + 2 * OUT_EPS[mx.float32] * np.abs(y_star) + 1e-30,
                                         err_msg=f"{name} bits={qt.segments[0].bits}")


def test_transposed_product(harness, tmp_path):
    """dx = dy · W, the gradient wrt x, as an aarch64 build runs it."""
    rng = np.random.default_rng(5)
    cases = []
    for bits in (2, 3, 4, 5, 6, 8):
        for gs in (32, 64, 128):
            x, qt = rand_case(rng, int(rng.choice([1, 5, 40, 130])), [(bits, gs, gs * int(rng.integers(1, 3)))],
                              SDTYPES[gs // 64], 1)
            dy = rng.standard_normal((int(rng.choice([1, 4, 9])), qt.shape[0])).astype(np.float32)
            cases.append((1, dy, qt))
    _, qt = rand_case(rng, 70, [(8, 32, 64), (3, 128, 128), (5, 64, 64)], mx.bfloat16, 1)
    cases.append((1, rng.standard_normal((6, 70)).astype(np.float32), qt))
    outs = run_qmm(harness, tmp_path, cases, ["t_ref", "t_neon"], threads=2)
    for (_, dy, qt), out in zip(cases, outs):
        w = dequantize_f64(qt)
        ref, mag = dy.astype(np.float64) @ w, np.abs(dy.astype(np.float64)) @ np.abs(w)
        for name in ("t_ref", "t_neon"):
            assert_close(out[name], ref, mag, f"{name} bits={qt.segments[0].bits}")
