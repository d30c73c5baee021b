"""The fp-mode GEMV (metal/fp_qmv.metal), run unchanged on the SIMT emulator
with the launch FpQMatmul::eval_gpu makes (metal/fp_qmv_host.h), against
float64 numpy of mx.dequantize: random shapes of every mode x activation
dtype, every code under many scale bytes bit for bit, MLX's inf / NaN
scales. Checks kernel logic, the bit layout and the launch plan; Apple's
compiler and the speed only a Mac checks (check_on_mac.sh)."""

import mlx.core as mx
import numpy as np
import pytest

import metal_emu as E
from test_metal_kernels import ACTS, MX_DTYPE, assert_close

MODES = {"mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}


@pytest.fixture(scope="module", autouse=True)
def emulator():
    if E.compiler() is None:
        pytest.skip("no C++ compiler to build the Metal emulator")
    E.lib()


def to_storage(a: mx.array) -> np.ndarray:
    """An MLX array as the raw storage a kernel reads (bfloat16 as bits)."""
    return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)


def dequantized(wq: np.ndarray, scales: np.ndarray, mode: str) -> np.ndarray:
    """W as float64 of mx.dequantize's float32 (the reference decode). MLX
    0.32.4 fails to reshape fewer than 32 values in all (nvfp4, one row of
    16): the rows are then given twice and the copy dropped."""
    N = wq.shape[0]
    if N * wq.shape[1] * 32 // MODES[mode][1] % 32:
        wq, scales = np.concatenate([wq, wq]), np.concatenate([scales, scales])
    W = mx.dequantize(mx.array(wq), mx.array(scales), mode=mode, dtype=mx.float32)
    return np.array(W, dtype=np.float64)[:N]


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """[N, K] codes -> uint32 [N, K*bits/32], LSB first, as MLX packs them."""
    per = 32 // bits
    c = codes.astype(np.uint32).reshape(codes.shape[0], -1, per)
    return np.bitwise_or.reduce(c << (bits * np.arange(per, dtype=np.uint32)), axis=2)


def shapes(mode):
    """(M, N, K): odd N, K a multiple of the group, below / at / above one
    simdgroup step of 512 columns and not a multiple of it; M 1..8."""
    g, _ = MODES[mode]
    return [(1, 1, g), (2, 7, 3 * g), (3, 37, 512), (5, 9, 512 + g), (8, 13, 1024 + 2 * g),
            (4, 65, 17 * g), (7, 3, 16 * g)]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("mode", MODES)
def test_random_shapes_against_dequantize(mode, act):
    rng = np.random.default_rng(list(MODES).index(mode) * 3 + ACTS.index(act))
    for i, (M, N, K) in enumerate(shapes(mode)):
        # (mx.quantize wants a multiple of 32 values in all: one row more,
        # dropped, where N * K is not; rows are quantized independently.)
        w = mx.array(rng.standard_normal((N + (N * K % 32 != 0), K)).astype(np.float32))
        wq, s = (np.array(a)[:N] for a in mx.quantize(w, mode=mode))
        W = dequantized(wq, s, mode)
        x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(MX_DTYPE[act])
        xs = to_storage(x)
        xf = E.storage_to_f64(xs, act)
        order = ("forward", "reverse", "shuffle")[i % 3]
        y = E.fp_qmv(xs, act, wq, s, mode, order=order, seed=i + 1)
        assert y.dtype == E.storage_dtype(act)
        assert_close(y, act, xf @ W.T, np.abs(xf) @ np.abs(W).T)


def code_grid(mode, scale_bytes):
    """Row n: scale byte scale_bytes[n // ncodes], code (n + j) % ncodes in
    column j, so every column holds every code under every scale byte; but
    e4m3's NaN codes (0x7f, 0xff), which would make every row's sum NaN,
    are the zeros of their sign here (test_nan_codes checks them)."""
    g, bits = MODES[mode]
    ncodes = 1 << bits
    K = max(g, ncodes)
    N = ncodes * len(scale_bytes)
    n = np.arange(N)[:, None]
    codes = (n + np.arange(K)[None, :]) % ncodes
    if bits == 8:
        codes = np.where(codes & 0x7F == 0x7F, codes & 0x80, codes)
    scales = np.repeat(np.asarray(scale_bytes, np.uint8), ncodes)[:, None]
    return pack(codes, bits), np.repeat(scales, K // g, axis=1)


# Every e8m0 byte for the 4-bit modes (cheap); for mxfp8's 256 codes the
# edges and a few in between. nvfp4's scales are e4m3: every byte too,
# negative, subnormal and NaN ones included.
SCALE_BYTES = {"mxfp4": list(range(256)), "nvfp4": list(range(256)),
               "mxfp8": [0, 1, 2, 64, 119, 126, 127, 128, 135, 200, 253, 254, 255]}


@pytest.mark.parametrize("mode", MODES)
def test_every_code_and_scale_exact(mode):
    """x = one-hot rows: y[m, n] = W[n, col_m] exactly (the other products
    are zeros), so every decoded weight must be mx.dequantize's bit for bit;
    a row with an inf or NaN weight is NaN (0 · inf), as float64's sum."""
    wq, s = code_grid(mode, SCALE_BYTES[mode])
    W = dequantized(wq, s, mode)
    K = W.shape[1]
    cols = np.array([0, 1, 5, 8, K // 2 + 3, K - 9, K - 2, K - 1])
    x = np.zeros((8, K), np.float32)
    x[np.arange(8), cols] = 1.0
    with np.errstate(invalid="ignore", over="ignore"):
        want = x.astype(np.float64) @ W.T
    assert np.isfinite(want).mean() > 0.5
    got = E.fp_qmv(x, "float32", wq, s, mode).astype(np.float64)
    np.testing.assert_array_equal(got, want)
    # The finite rows carry the decoded values themselves.
    fin = np.isfinite(W).all(axis=1)
    np.testing.assert_array_equal(got[:, fin], W[fin][:, cols].T)


def test_inf_and_nan_scales_as_mx_dequantize():
    """e8m0 255 is 2^128 = inf (MLX's exp2, not OCP's NaN): a zero code
    under it is NaN, so is the row's sum; with only positive codes and
    positive x the sum is +inf. e4m3 scale 0x7f is NaN; e8m0 0 is 2^-127."""
    K = 32
    pos = np.full((1, K), 2, np.uint8)      # e2m1 code 2 = 1.0
    with_zero = pos.copy()
    with_zero[0, 5] = 0
    x = np.ones((1, K), np.float32)
    run = lambda codes, sb, mode: E.fp_qmv(  # noqa: E731
        x, "float32", pack(codes, 4), np.full((1, 1 if mode == "mxfp4" else 2), sb, np.uint8),
        mode)[0, 0]
    assert run(pos, 255, "mxfp4") == np.inf
    assert np.isnan(run(with_zero, 255, "mxfp4"))
    assert np.isnan(run(pos, 0x7F, "nvfp4"))
    assert run(pos, 0, "mxfp4") == np.float32(K * 2.0**-127)
    assert run(pos, 0x38, "nvfp4") == K  # e4m3 0x38 = 1.0


def test_nan_codes():
    """mxfp8's codes 0x7f and 0xff are NaN (e4m3 has no inf): one in a row
    makes its sum NaN; the rows without stay exact."""
    codes = np.full((3, 32), 0x38, np.uint8)  # 1.0
    codes[0, 4], codes[2, 31] = 0x7F, 0xFF
    x = np.ones((2, 32), np.float32)
    y = E.fp_qmv(x, "float32", pack(codes, 8), np.full((3, 1), 127, np.uint8), "mxfp8")
    assert np.isnan(y[:, [0, 2]]).all() and (y[:, 1] == 32).all()


@pytest.mark.parametrize("act", ACTS)
def test_narrow_outputs_round_like_the_dtype(act):
    """Exact sums stored in float16 / bfloat16 round to nearest as MLX's
    astype does (6 · 2^127 and the like overflow to inf in both)."""
    mode = "mxfp8"
    wq, s = code_grid(mode, [100, 127, 130])
    W = dequantized(wq, s, mode)
    x = np.zeros((2, W.shape[1]), np.float32)
    x[0, 3] = x[1, 77] = 1.0
    xs = to_storage(mx.array(x).astype(MX_DTYPE[act]))
    got = E.storage_to_f64(E.fp_qmv(xs, act, wq, s, mode), act)
    want = np.array(mx.array((x @ W.T.astype(np.float32))).astype(MX_DTYPE[act])
                    .astype(mx.float32), dtype=np.float64)
    np.testing.assert_array_equal(got, want)


def test_launch_plan():
    assert E.fp_qmv_kernel(1, 3, 64, "nvfp4", "bfloat16") == "mixbits_fp_qmv_nvfp4_bfloat16"
    assert E.fp_qmv_kernel(8, 3, 64, "mxfp8", "float32") == "mixbits_fp_qmv_mxfp8_float32"
    with pytest.raises(E.EmulatorError, match="more than 8 rows"):
        E.fp_qmv_kernel(9, 3, 64, "mxfp4", "float32")
    with pytest.raises(E.EmulatorError, match="multiple of the group"):
        E.fp_qmv_kernel(1, 3, 48, "mxfp4", "float32")


def test_harness_refuses_buffers_of_another_size():
    """A scales array of the wrong size is refused before the kernel runs
    (the launch binds N * K / group bytes), not read past its end."""
    wq = np.zeros((3, 8), np.uint32)       # mxfp4, K = 64
    x = np.zeros((1, 64), np.float32)
    with pytest.raises(E.EmulatorError, match="scales"):
        E.fp_qmv(x, "float32", wq, np.zeros((3, 1), np.uint8), "mxfp4")
