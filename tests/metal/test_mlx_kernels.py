"""MLX's own affine quantized Metal kernels (compiled from the installed,
pinned mlx package's headers, mlx_emu.py) on the SIMT emulator: each kernel
MLX's host code picks for these shapes computes y = x W^T (against a float64
reference built from MLX's bit layout, and against mx.quantized_matmul on
the CPU), and its counted traffic touches exactly the analytic minimum of
distinct bytes. Missing headers or compiler are failures, not skips."""

import re

import mlx.core as mx
import numpy as np
import pytest

import metal_traffic as T
import mlx_emu as X


def dequant64(wq: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> np.ndarray:
    """MLX's affine 4-bit layout in float64: code j of a row is bits 4 (j % 8)
    .. of uint32 word j / 8; w = scale * code + bias per group of 64."""
    N = wq.shape[0]
    shifts = 4 * np.arange(8, dtype=np.uint32)
    q = ((wq[:, :, None] >> shifts) & 15).reshape(N, -1).astype(np.float64)
    rep = lambda a: np.repeat(a.astype(np.float64), 64, axis=1)  # noqa: E731
    return q * rep(scales) + rep(biases)


def problem(M, N, K, seed=0):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((N, K)).astype(np.float16))
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    x = rng.standard_normal((M, K)).astype(np.float16)
    return x, np.array(wq), np.array(s), np.array(b)


def test_headers_are_the_installed_mlx_version():
    inc = X.mlx_include()  # raises if missing: never a skip
    text = (inc / "mlx" / "version.h").read_text()
    ver = ".".join(re.search(rf"#define MLX_VERSION_{k} (\d+)", text).group(1)
                   for k in ("MAJOR", "MINOR", "PATCH"))
    assert ver == mx.__version__.split(".dev")[0]


def test_reference_decodes_mlx_layout():
    x, wq, s, b = problem(1, 16, 128)
    got = np.array(mx.dequantize(mx.array(wq), mx.array(s), mx.array(b), group_size=64, bits=4,
                                 stream=mx.cpu)).astype(np.float64)
    ref = dequant64(wq, s, b)
    # MLX's CPU dequantize rounds scale * code to float16 before adding the
    # bias: equal up to float16 rounding; a wrong code order is off by whole
    # multiples of the scale.
    np.testing.assert_allclose(got, ref, rtol=0, atol=2.0**-10 * np.abs(ref).max())


# (M, N, K, gpu family, kernel MLX picks): every kernel kind the comparison
# runs, tiled ones with a partial and a full M tile, N aligned and not.
CASES = [
    (1, 256, 512, "m1m2", "affine_qmv_fast_float16_t_gs_64_b_4_batch_0"),
    (8, 256, 512, "m1m2", "affine_qmv_fast_float16_t_gs_64_b_4_batch_0"),
    (1, 64, 576, "m1m2", "affine_qmv_float16_t_gs_64_b_4_batch_0"),
    (8, 256, 512, "m3m4", "affine_qmv_wide_float16_t_gs_64_b_4_nv_4_kl_8_batch_0"),
    (3, 64, 512, "m3m4", "affine_qmv_wide_float16_t_gs_64_b_4_nv_3_kl_8_batch_0"),
    (17, 64, 64, "m1m2", "affine_qmm_t_float16_t_gs_64_b_4_alN_true_batch_0"),
    (40, 40, 64, "m3m4", "affine_qmm_t_float16_t_gs_64_b_4_alN_false_batch_0"),
    (17, 64, 512, "m1m2", "affine_qmm_t_splitk_float16_t_gs_64_b_4_alN_true"),
    (32, 40, 256, "m3m4", "affine_qmm_t_splitk_float16_t_gs_64_b_4_alN_false"),
]


@pytest.mark.parametrize("M,N,K,gpu,kernel", CASES)
def test_mlx_kernel_result_and_distinct_bytes(M, N, K, gpu, kernel):
    assert X.plan(M, N, K, gpu)["kernel"] == kernel
    x, wq, s, b = problem(M, N, K, seed=M * N + K)
    with X.counting() as rec:
        y = X.run(x, wq, s, b, gpu=gpu).astype(np.float64)
    ref64 = x.astype(np.float64) @ dequant64(wq, s, b).T
    # The kernel accumulates in float32 and rounds once to float16: within
    # one float16 ulp of the largest output.
    assert np.abs(y - ref64).max() <= 2.0**-10 * np.abs(ref64).max()
    # MLX's CPU kernel rounds its partial sums to float16, so it is looser.
    cpu = np.array(mx.quantized_matmul(mx.array(x), mx.array(wq), mx.array(s), mx.array(b),
                                       transpose=True, group_size=64, bits=4, stream=mx.cpu))
    assert np.abs(y - cpu.astype(np.float64)).max() <= 2.0**-5 * np.abs(ref64).max()

    assert [r["kernel"] for r in rec] == [kernel]
    p = X.plan(M, N, K, gpu)
    if p["kind"] == "qmm_t_splitk":
        # Float32 partials [split_k, M, N] written once each: counted, and
        # added to the analytic minimum (read back by MLX's reduce, whose
        # record is analytic).
        assert rec[0]["device_unique_write_bytes"] == 4 * p["split_k"] * M * N
        rec.append(X.reduce_record(M, N, p["split_k"]))
    case = {"op": "mlx_qmatmul", "M": M, "N": N, "K": K, "segments": [[4, 64, K]],
            "perm": False, "x_dtype": "float16", "scale_dtype": "float16"}
    r = T.summarize(case, rec)
    # Every weight, scale, bias and x byte read, every y byte written: no
    # more, no less (the analytic minimum), whatever the re-reads.
    extra = 8 * p["split_k"] * M * N if p["kind"] == "qmm_t_splitk" else 0
    assert r["unique_read"] + r["unique_written"] == r["analytic_min"] + extra
    assert r["unique_written"] == 2 * M * N + extra // 2
    assert r["bytes_read"] >= r["unique_read"]
