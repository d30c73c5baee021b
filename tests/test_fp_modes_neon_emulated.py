"""The fp-mode matmul's aarch64 kernel (cpp/fpmatmul/neon.cpp, the CPU path
of a Mac), built for aarch64 and run under qemu-user on mx.quantize's own
codes and scales (tests/neon/fpm_harness.cpp): the NEON kernel and the
scalar reference of that build against float64 x @ W.T of mx.dequantize,
every code under every scale byte exactly, and 1 vs 2 threads bit for bit.
qemu checks results, not speed."""

import struct

import mlx.core as mx
import numpy as np
import pytest

from neon_emulator import build, run
from test_fp_modes_kernel import MODES, all_codes, assert_close, dequantized, finite_rows, quantized

FPM_SOURCES = [
    "tests/neon/fpm_harness.cpp",
    "cpp/common/backend.cpp", "cpp/common/cpu.cpp", "cpp/common/parallel.cpp",
    "cpp/fpmatmul/ref.cpp", "cpp/fpmatmul/dispatch.cpp", "cpp/fpmatmul/neon.cpp",
    "cpp/fpmatmul/neon_t.cpp",
]
MODE_ID = {"mxfp4": 0, "nvfp4": 1, "mxfp8": 2}


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return build(tmp_path_factory.mktemp("neon") / "fpm_harness", FPM_SOURCES)


def run_cases(exe, tmp, cases, threads=1):
    """cases: (mode, x float32, wq, scales[, transpose]) -> per case (ref,
    neon) y; x [M, K] (y = x W^T) or, with transpose False, [M, N] (x W)."""
    cases = [c if len(c) == 5 else (*c, True) for c in cases]
    with open(tmp / "cases.bin", "wb") as f:
        f.write(b"MBF1" + struct.pack("<I", len(cases)))
        for mode, x, wq, s, t in cases:
            k = s.shape[1] * MODES[mode][0]
            f.write(struct.pack("<5i", MODE_ID[mode], int(t), x.shape[0], wq.shape[0], k))
            f.write(np.ascontiguousarray(x, np.float32).tobytes())
            f.write(np.array(wq).tobytes() + np.array(s).tobytes())
    r = run(exe, tmp / "cases.bin", tmp / "out.bin", threads=threads)
    assert r.returncode == 0, r.stdout + r.stderr
    flat = np.fromfile(tmp / "out.bin", np.float32).astype(np.float64)
    out, at = [], 0
    for mode, x, wq, s, t in cases:
        size = x.shape[0] * (wq.shape[0] if t else s.shape[1] * MODES[mode][0])
        out.append(tuple(flat[at + i * size: at + (i + 1) * size].reshape(x.shape[0], -1) for i in (0, 1)))
        at += 2 * size
    assert at == flat.size
    return out


def random_cases(rng):
    cases = []
    for mode, (g, _) in MODES.items():
        for m in (1, 3, 17):
            n = int(rng.choice([2, 16, 37]))
            k = g * int(rng.integers(2, 9))
            n += n * k % 32 != 0  # MLX's nvfp4 quantize needs N*K % 32 == 0
            wq, s = quantized(rng, n, k, mode, scale=float(rng.choice([0.05, 1.0, 50.0])))
            cases.append((mode, rng.standard_normal((m, k)).astype(np.float32), wq, s))
    return cases


def test_neon_not_transposed_matches_float64_and_threads(harness, tmp_path):
    """transpose=False (y = x @ W, also the gradient of x @ W^T)."""
    rng = np.random.default_rng(22)
    cases = []
    for mode, x, wq, s in random_cases(rng):
        x = rng.standard_normal((x.shape[0], wq.shape[0])).astype(np.float32)
        cases.append((mode, x, wq, s, False))
    one = run_cases(harness, tmp_path, cases, threads=1)
    two = run_cases(harness, tmp_path, cases, threads=2)
    for (mode, x, wq, s, _), (ref, neon), (_, neon2) in zip(cases, one, two):
        w64 = dequantized(wq, s, mode)
        what = f"T {mode} M={x.shape[0]} R={wq.shape[0]} C={w64.shape[1]}"
        assert_close(ref, x.astype(np.float64), w64.T, mx.float32, "ref " + what)
        assert_close(neon, x.astype(np.float64), w64.T, mx.float32, "neon " + what)
        np.testing.assert_array_equal(neon, neon2, err_msg="threads " + what)


def test_neon_matches_float64_and_threads(harness, tmp_path):
    cases = random_cases(np.random.default_rng(21))
    one = run_cases(harness, tmp_path, cases, threads=1)
    two = run_cases(harness, tmp_path, cases, threads=2)
    for (mode, x, wq, s), (ref, neon), (_, neon2) in zip(cases, one, two):
        w64 = dequantized(wq, s, mode)
        what = f"{mode} M={x.shape[0]} N={wq.shape[0]} K={x.shape[1]}"
        assert_close(ref, x.astype(np.float64), w64, mx.float32, "ref " + what)
        assert_close(neon, x.astype(np.float64), w64, mx.float32, "neon " + what)
        np.testing.assert_array_equal(neon, neon2, err_msg="threads " + what)


@pytest.mark.parametrize("mode", list(MODES))
def test_neon_every_code_and_scale_exact(harness, tmp_path, mode):
    codes, wq, s = all_codes(mode, finite=True)
    k = codes.shape[1]
    with np.errstate(invalid="ignore", over="ignore"):
        want = np.eye(k) @ dequantized(wq, s, mode).T
    [(ref, neon)] = run_cases(harness, tmp_path, [(mode, np.eye(k, dtype=np.float32), wq, s)])
    np.testing.assert_array_equal(ref, want)
    np.testing.assert_array_equal(neon, want)
    # transpose=False: x = the identity gives W itself (its finite rows:
    # every output sums over all rows)
    wq, s = finite_rows(mode)
    want = dequantized(wq, s, mode)
    x = np.eye(want.shape[0], dtype=np.float32)
    [(ref, neon)] = run_cases(harness, tmp_path, [(mode, x, wq, s, False)])
    np.testing.assert_array_equal(ref, want)
    np.testing.assert_array_equal(neon, want)
