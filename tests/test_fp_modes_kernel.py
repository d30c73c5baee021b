"""mixbits' CPU kernels for MLX's fp quantization modes (cpp/fpmatmul):
mxfp4 (e2m1 codes, 32 per e8m0 scale), nvfp4 (e2m1, 16 per e4m3 scale),
mxfp8 (e4m3, 32 per e8m0). Checked against float64 products of
``mx.dequantize``'s float32 weights (MLX's own decoding, independent of the
kernels), exactly where the product is exact; the scalar reference and the
SIMD kernel against each other; 1 vs 2 threads bit for bit; MLX's argument
errors; gradients; and test_quantized's fp-mode grids of MLX itself."""

import zlib

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from mixbits import _ext, ops

MODES = {"mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
DTYPES = [mx.float32, mx.float16, mx.bfloat16]
BACKENDS = ops.available_fp_backends()
# Relative to sum |x||w| per output: float32 accumulation (the SIMD kernels
# sum in float32; the reference in float64) plus the output's rounding.
ACC_TOL = 2e-6
MLX_TOL = {mx.float32: 2e-5, mx.float16: 1e-2, mx.bfloat16: 5e-2}
OUT_EPS = {mx.float32: 2.0 ** -24, mx.float16: 2.0 ** -11, mx.bfloat16: 2.0 ** -8}


def f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


def dequantized(wq, s, mode):
    return f64(mx.dequantize(wq, s, mode=mode, dtype=mx.float32))


def quantized(rng, n, k, mode, scale=1.0):
    w = mx.array((rng.standard_normal((n, k)) * scale).astype(np.float32))
    wq, s = mx.quantize(w, mode=mode)
    return wq, s


def assert_close(got: np.ndarray, x64, w64, dtype, what):
    ref = x64 @ w64.T
    mag = np.abs(x64) @ np.abs(w64).T
    # (+ half float16's subnormal spacing: a tiny output rounds absolutely)
    tol = ACC_TOL * mag + OUT_EPS[dtype] * np.abs(ref) + (2.0 ** -25 if dtype == mx.float16 else 1e-30)
    bad = ~(np.abs(got - ref) <= tol)
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} off; first at {i}: "
                             f"got {got[i]}, want {ref[i]}, tol {tol[i]}")


# ------------------------------------------------ the formats themselves

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def spec_e4m3(c: np.ndarray) -> np.ndarray:
    """OCP e4m3 (bias 7, no inf, S.1111.111 NaN), float64."""
    c = c.astype(np.int64)
    e, m = (c >> 3) & 15, c & 7
    v = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    v = np.where((e == 15) & (m == 7), np.nan, v)
    return np.where(c & 0x80, -v, v)


def spec_e8m0(s: np.ndarray) -> np.ndarray:
    """2^(s-127) (MLX: s = 255 is inf, not the OCP NaN)."""
    return np.where(s == 255, np.inf, 2.0 ** (s.astype(np.float64) - 127))


def all_codes(mode, finite=False):
    """A weight holding every code under every scale byte: row r has scale
    byte r (256 rows) in every group, the codes cycling along the row.
    finite: without the NaN codes (e4m3 0x7f, 0xff), which would make every
    sum of their row NaN, so a test of exact sums would check nothing."""
    g, bits = MODES[mode]
    n_codes = 1 << bits
    k = max(g, n_codes)
    codes = np.tile(np.arange(k) % n_codes, (256, 1)).astype(np.uint32)
    if finite and bits == 8:
        codes[(codes & 0x7f) == 0x7f] = 0
    if bits == 4:
        wq = np.zeros((256, k // 8), np.uint32)
        for j in range(k):
            wq[:, j // 8] |= codes[:, j] << np.uint32(4 * (j % 8))
    else:
        wq = codes.astype(np.uint8).reshape(256, k // 4, 4).view(np.uint32).reshape(256, k // 4)
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], k // g, axis=1)
    return codes, mx.array(wq), mx.array(scales)


def finite_rows(mode):
    """all_codes' rows whose decoded values are all finite (here every
    output of x @ W sums over all rows of W, so one inf or NaN row would
    make every output NaN and the check vacuous): most scale bytes."""
    codes, wq, s = all_codes(mode, finite=True)
    with np.errstate(invalid="ignore", over="ignore"):
        keep = np.flatnonzero(np.isfinite(dequantized(wq, s, mode)).all(axis=1))
    assert keep.size >= 200
    idx = mx.array(keep.astype(np.int32))
    return mx.contiguous(wq[idx]), mx.contiguous(s[idx])


@pytest.mark.parametrize("mode", list(MODES))
def test_spec_decode_is_mlx_dequantize(mode):
    """The format as documented (numpy float64, rounded to float32 as MLX
    computes) is mx.dequantize's float32 output for every code and scale
    byte: what the kernels implement is MLX's format, edge cases included."""
    g, bits = MODES[mode]
    codes, wq, s = all_codes(mode)
    val = E2M1[codes] if bits == 4 else spec_e4m3(codes)
    sc = spec_e4m3(np.arange(256)) if mode == "nvfp4" else spec_e8m0(np.arange(256))
    with np.errstate(over="ignore", invalid="ignore"):
        want = (val * sc[:, None]).astype(np.float32)
    got = np.array(mx.dequantize(wq, s, mode=mode, dtype=mx.float32))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_every_code_and_scale_exact_not_transposed(mode, backend):
    """transpose=False (y = x @ W) with x = the identity is W itself: the
    decoded values of the column kernels, bit for bit (one output chain per
    value, the rest zeros; every scale byte whose row is finite)."""
    wq, s = finite_rows(mode)
    want = dequantized(wq, s, mode)
    r = want.shape[0]
    for m in (1, r):
        x = mx.eye(r, dtype=mx.float32)[:m]
        got = f64(mixbits.quantized_matmul(x, wq, s, mode=mode, transpose=False, backend=backend))
        np.testing.assert_array_equal(got, want[:m], err_msg=f"{mode} {backend} M={m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_every_code_and_scale_exact(mode, backend):
    """x = the identity: y = W^T exactly (one product per output, the rest
    zeros), so every decoded value must equal mx.dequantize's bit for bit.
    The scale byte 255 (inf) makes its row's sums NaN (inf times the zeros),
    as in MLX's product; the NaN codes are checked the same way below."""
    codes, wq, s = all_codes(mode, finite=True)
    k = codes.shape[1]
    x = mx.eye(k, dtype=mx.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        want = np.eye(k) @ dequantized(wq, s, mode).T
    # NaN only in the rows of scale byte 255 (inf) and, in nvfp4, of the NaN
    # e4m3 scales; inf where 6·2^127 overflows, as in mx.dequantize.
    assert np.isfinite(want).mean() > 0.9
    for m in (1, k):  # the fused (few rows) and the buffered (many rows) paths
        got = f64(mixbits.quantized_matmul(x[:m], wq, s, mode=mode, backend=backend))
        np.testing.assert_array_equal(got, want[:m], err_msg=f"{mode} {backend} M={m}")
    if mode == "mxfp8":  # the NaN codes: their rows' sums are NaN, as float64's
        codes, wq, s = all_codes(mode)
        with np.errstate(invalid="ignore", over="ignore"):
            want = np.eye(k) @ dequantized(wq, s, mode).T
        got = f64(mixbits.quantized_matmul(x[:3], wq, s, mode=mode, backend=backend))
        assert np.isnan(want[:3]).all() and np.isnan(got).all()


# ------------------------------------------------ products

def shapes(rng, mode, count=6):
    g, _ = MODES[mode]
    out = []
    for i in range(count):
        m = [1, 2, 3, 4, 5, 17][i]
        n = int(rng.choice([1, 3, 7, 16, 33, 61]))
        k = g * int(rng.integers(1, 9))
        # mx.quantize / mx.dequantize in nvfp4 fail to reshape unless N*K
        # is a multiple of 32 (N = 1, K = 48 raises in MLX 0.32.4)
        n += n * k % 32 != 0
        out.append((m, n, k))
    return out


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_shapes_against_float64(mode, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{mode} {dtype}".encode()))
    for m, n, k in shapes(rng, mode):
        wq, s = quantized(rng, n, k, mode, scale=float(rng.choice([0.05, 1.0, 50.0])))
        w64 = dequantized(wq, s, mode)
        x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
        x64 = f64(x)
        for backend in BACKENDS:
            y = mixbits.quantized_matmul(x, wq, s, mode=mode, backend=backend)
            assert y.dtype == dtype and y.shape == (m, n)
            assert_close(f64(y), x64, w64, dtype, f"{mode} {dtype} {backend} M={m} N={n} K={k}")
        # MLX's op on the same call, held to test_qmatmul_modes' looser
        # bound (it accumulates half-precision x in half precision).
        ref = x64 @ w64.T
        want = f64(mx.quantized_matmul(x, wq, s, mode=mode))
        assert np.abs(want - ref).max() <= MLX_TOL[dtype] * (np.abs(ref).max() + 1e-30)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_shapes_not_transposed(mode, dtype):
    """y = x @ W with W (R, C) grouped along C (MLX's transpose=False)."""
    rng = np.random.default_rng(zlib.crc32(f"T {mode} {dtype}".encode()))
    for m, c, r in shapes(rng, mode):  # (rows of x, R, C): C a multiple of the group
        c += c * r % 32 != 0
        wq, s = quantized(rng, c, r, mode, scale=float(rng.choice([0.05, 1.0, 50.0])))
        w64 = dequantized(wq, s, mode)  # (R, C) = (c, r) here
        x = mx.array(rng.standard_normal((m, c)).astype(np.float32)).astype(dtype)
        for backend in BACKENDS:
            y = mixbits.quantized_matmul(x, wq, s, mode=mode, transpose=False, backend=backend)
            assert y.dtype == dtype and y.shape == (m, r)
            assert_close(f64(y), f64(x), w64.T, dtype, f"T {mode} {dtype} {backend} M={m} R={c} C={r}")


@pytest.mark.parametrize("mode", list(MODES))
def test_leading_dims_and_strided_x(mode):
    rng = np.random.default_rng(5)
    g, _ = MODES[mode]
    wq, s = quantized(rng, 24, 4 * g, mode)
    w64 = dequantized(wq, s, mode)
    x = mx.array(rng.standard_normal((2, 3, 4 * g)).astype(np.float32))
    for xx in (x, x[0], x[0, 0], mx.swapaxes(mx.swapaxes(x, 0, 1), 0, 1)[:, ::2]):
        y = mixbits.quantized_matmul(xx, wq, s, mode=mode)
        assert y.shape == xx.shape[:-1] + (24,)
        assert_close(f64(y).reshape(-1, 24), f64(xx).reshape(-1, 4 * g), w64, mx.float32, str(xx.shape))


@pytest.mark.parametrize("mode", list(MODES))
def test_threads_and_paths_bit_identical(mode):
    """The same sums at 1 and 2 threads, and (ref, avx2, and every backend
    for transpose=False) row by row (M = 1, the fused path) as in one call
    of many rows (the buffered path). avx512 sums rows beyond 4 in 16-lane
    chunks: its calls of at most 4 rows are avx2's bit for bit instead."""
    rng = np.random.default_rng(11)
    g, _ = MODES[mode]
    wq, s = quantized(rng, 203, 12 * g, mode)
    x = mx.array(rng.standard_normal((9, 12 * g)).astype(np.float32))
    prev = _ext.max_threads()
    try:
        for backend in BACKENDS:
            outs = []
            for t in (1, 2):
                _ext.set_max_threads(t)
                outs.append(np.array(mixbits.quantized_matmul(x, wq, s, mode=mode, backend=backend)))
            np.testing.assert_array_equal(outs[0], outs[1], err_msg=backend)
            rows = np.concatenate([np.array(mixbits.quantized_matmul(x[i:i + 1], wq, s, mode=mode,
                                                                     backend=backend))
                                   for i in range(9)])
            if backend == "avx512":
                for m in (1, 4):
                    np.testing.assert_array_equal(
                        np.array(mixbits.quantized_matmul(x[:m], wq, s, mode=mode, backend=backend)),
                        np.array(mixbits.quantized_matmul(x[:m], wq, s, mode=mode, backend="avx2")))
            else:
                np.testing.assert_array_equal(rows, outs[0], err_msg=backend)
            # transpose=False: its own column split; 203 rows of W are its K
            xt = mx.array(rng.standard_normal((7, 203)).astype(np.float32))
            outs = []
            for t in (1, 2):
                _ext.set_max_threads(t)
                outs.append(np.array(mixbits.quantized_matmul(xt, wq, s, mode=mode, transpose=False,
                                                              backend=backend)))
            np.testing.assert_array_equal(outs[0], outs[1], err_msg="transpose=False " + backend)
            rows = np.concatenate([np.array(mixbits.quantized_matmul(xt[i:i + 1], wq, s, mode=mode,
                                                                     transpose=False, backend=backend))
                                   for i in range(7)])
            np.testing.assert_array_equal(rows, outs[0], err_msg="transpose=False " + backend)
    finally:
        _ext.set_max_threads(prev)


@pytest.mark.parametrize("mode", list(MODES))
def test_reference_and_simd_agree(mode):
    rng = np.random.default_rng(12)
    g, _ = MODES[mode]
    wq, s = quantized(rng, 64, 16 * g, mode)
    x = mx.array(rng.standard_normal((6, 16 * g)).astype(np.float32))
    ref = f64(mixbits.quantized_matmul(x, wq, s, mode=mode, backend="ref"))
    mag = np.abs(f64(x)) @ np.abs(dequantized(wq, s, mode)).T
    for backend in BACKENDS:
        got = f64(mixbits.quantized_matmul(x, wq, s, mode=mode, backend=backend))
        assert (np.abs(got - ref) <= ACC_TOL * mag).all(), backend


@pytest.mark.parametrize("transpose", [True, False])
def test_empty_shapes(transpose):
    """No rows of x, no outputs, or an empty sum (zeros; MLX 0.32.4's own
    op dies of SIGFPE on that one, so it is not compared)."""
    rng = np.random.default_rng(18)
    wq, s = quantized(rng, 32, 64, "mxfp4")
    k = 64 if transpose else 32
    assert mixbits.quantized_matmul(mx.zeros((0, k)), wq, s, mode="mxfp4", transpose=transpose).shape == (0, 96 - k)
    empty_q, empty_s = mx.zeros((4, 0), mx.uint32), mx.zeros((4, 0), mx.uint8)
    x = mx.ones((2, 0) if transpose else (2, 4))
    y = mixbits.quantized_matmul(x, empty_q, empty_s, mode="mxfp4", transpose=transpose)
    assert y.shape == ((2, 4) if transpose else (2, 0)) and not mx.any(y).item()
    if not transpose:  # W with no rows: x has no columns
        y = mixbits.quantized_matmul(mx.ones((2, 0)), mx.zeros((0, 4), mx.uint32), mx.zeros((0, 1), mx.uint8),
                                     mode="mxfp4", transpose=False)
        assert y.shape == (2, 32) and not mx.any(y).item()


def test_inf_and_nan_in_x_as_mlx():
    rng = np.random.default_rng(13)
    wq, s = quantized(rng, 8, 64, "mxfp4")
    x = np.array(rng.standard_normal((3, 64)), np.float32)
    x[0, 5] = np.inf
    x[1, 7] = np.nan
    got = np.array(mixbits.quantized_matmul(mx.array(x), wq, s, mode="mxfp4"))
    with np.errstate(invalid="ignore"):
        want = x.astype(np.float64) @ dequantized(wq, s, "mxfp4").T
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))


# ------------------------------------------------ routing

def test_cpu_fp_calls_run_the_kernel(monkeypatch):
    """A 2-D w on the CPU runs mixbits' node, either transpose; a stack of
    matrices MLX's op."""
    rng = np.random.default_rng(14)
    seen = []
    real = _ext.fp_qmatmul
    monkeypatch.setattr(_ext, "fp_qmatmul", lambda *a: seen.append(a[3:5]) or real(*a))
    x = mx.array(rng.standard_normal((2, 64)).astype(np.float32))
    for i, mode in enumerate(MODES):
        wq, s = quantized(rng, 64, 64, mode)
        mixbits.quantized_matmul(x, wq, s, mode=mode)
        mixbits.quantized_matmul(x, wq, s, mode=mode, transpose=False)
        mixbits.quantized_matmul(x[None], mx.stack([wq, wq]), mx.stack([s, s]), mode=mode)
    assert seen == [(0, True), (0, False), (1, True), (1, False), (2, True), (2, False)]


# ------------------------------------------------ errors, as MLX's

@pytest.mark.parametrize("mode", list(MODES))
def test_bad_input_raises_mlx_exception_types(mode):
    rng = np.random.default_rng(15)
    g, bits = MODES[mode]
    wq, s = quantized(rng, 8, 64, mode)
    x = mx.array(rng.standard_normal((2, 64)).astype(np.float32))

    def both(exc, **kw):
        a = dict(x=x, w=wq, scales=s)
        a.update(kw)
        with pytest.raises(exc):
            mx.eval(mx.quantized_matmul(a["x"], a["w"], a["scales"], a.get("biases"), mode=mode))
        with pytest.raises(exc):
            mx.eval(mixbits.quantized_matmul(a["x"], a["w"], a["scales"], a.get("biases"), mode=mode))

    both(ValueError, scales=s.astype(mx.float32))          # scale dtype
    both(ValueError, scales=s[:, :1])                      # scale shape
    both(ValueError, biases=s)                             # fp modes have no biases
    both(ValueError, x=x.astype(mx.int32))                 # x dtype
    both(ValueError, x=x[:, :32])                          # x's K
    both(ValueError, w=wq.astype(mx.float32))              # code dtype
    # A group size or bit width the mode does not have: mx.quantize and
    # mx.dequantize refuse them with a ValueError (mx.quantized_matmul
    # reads the codes as the mode's anyway); so does mixbits.
    other_g = 64 if g != 64 else 32
    with pytest.raises(ValueError):
        mx.dequantize(wq, s, group_size=other_g, mode=mode)
    with pytest.raises(ValueError, match="group size"):
        mixbits.quantized_matmul(x, wq, s, group_size=other_g, mode=mode)
    with pytest.raises(ValueError, match="bits"):
        mixbits.quantized_matmul(x, wq, s, bits=12 - bits, mode=mode)
    with pytest.raises(ValueError):
        mixbits.quantized_matmul(x, wq, s, mode=mode, backend="neon" if "avx2" in BACKENDS else "avx2")


# ------------------------------------------------ gradients

@pytest.mark.parametrize("mode", list(MODES))
def test_vjp_not_transposed_and_kernel_grad(mode):
    """transpose=False: d/dx of x @ W is c @ W^T; both orientations' x
    gradients run mixbits' kernel of the other orientation, not MLX's op."""
    rng = np.random.default_rng(17)
    wq, s = quantized(rng, 96, 128, mode)  # W (96, 128): x has 96 columns
    x = mx.array(rng.standard_normal((4, 96)).astype(np.float32))
    c = mx.array(rng.standard_normal((4, 128)).astype(np.float32))
    _, (dx,) = mx.vjp(lambda x: mixbits.quantized_matmul(x, wq, s, mode=mode, transpose=False), (x,), (c,))
    want = f64(c) @ dequantized(wq, s, mode).T
    assert np.abs(f64(dx) - want).max() <= 1e-5 * np.abs(want).max()
    # Bit for bit the other orientation's mixbits kernel (and not MLX's op,
    # which sums in another order: so the check can tell them apart).
    for t, xx, cc in ((False, x, c), (True, c, x)):
        _, (g,) = mx.vjp(lambda v: mixbits.quantized_matmul(v, wq, s, mode=mode, transpose=t), (xx,), (cc,))
        ours = mixbits.quantized_matmul(cc, wq, s, mode=mode, transpose=not t)
        theirs = mx.quantized_matmul(cc, wq, s, mode=mode, transpose=not t)
        assert mx.array_equal(g, ours).item() and not mx.array_equal(g, theirs).item()


@pytest.mark.parametrize("mode", list(MODES))
def test_vjp_jvp_as_mlx(mode):
    """MLX's test_qmm_vjp / test_qmm_jvp in this mode: the vjp wrt x is
    the transposed product, the jvp the product of the tangent; the scales
    and codes refuse as MLX's (ValueError, RuntimeError)."""
    rng = np.random.default_rng(16)
    wq, s = quantized(rng, 96, 128, mode)
    x = mx.array(rng.standard_normal((2, 5, 128)).astype(np.float32))
    c = mx.array(rng.standard_normal((2, 5, 96)).astype(np.float32))
    fn = lambda x: mixbits.quantized_matmul(x, wq, s, mode=mode)
    _, (dx,) = mx.vjp(fn, (x,), (c,))
    want = f64(c) @ dequantized(wq, s, mode)
    assert np.abs(f64(dx) - want).max() <= 1e-5 * np.abs(want).max()
    _, (ty,) = mx.jvp(fn, (x,), (x,))
    assert mx.array_equal(ty, fn(x)).item()
    f_s = lambda s_: mixbits.quantized_matmul(x, wq, s_, mode=mode).sum()
    g_s = lambda s_: mx.quantized_matmul(x, wq, s_, mode=mode).sum()
    for f in (f_s, g_s):
        with pytest.raises(ValueError, match="no gradient wrt scales"):
            mx.grad(f)(s)
    for f in (lambda w: mixbits.quantized_matmul(x, w, s, mode=mode).sum(),
              lambda w: mx.quantized_matmul(x, w, s, mode=mode).sum()):
        with pytest.raises(RuntimeError, match="quantized weights"):
            mx.grad(f)(wq)


# ------------------------------------------------ MLX's own fp-mode cases

def mlx_case(mode, x_shape, n, k, key, tol, dtype=mx.float32, x_div=1.0):
    """test_quantized's pattern: y vs x @ dequantize(w).T, max abs error."""
    k1, k2 = mx.random.split(mx.random.key(key))
    x = (mx.random.normal(x_shape, key=k1) / x_div).astype(dtype)
    w = mx.random.normal((n, k), key=k2)
    wq, s = mx.quantize(w, mode=mode)
    w_hat = mx.dequantize(wq, s, mode=mode, dtype=mx.float32)
    want = x.astype(mx.float32) @ w_hat.T
    got = mixbits.quantized_matmul(x, wq, s, transpose=True, mode=mode)
    assert got.shape == want.shape and got.dtype == dtype
    assert (got.astype(mx.float32) - want).abs().max().item() < tol, (mode, x_shape, n, k)


@pytest.mark.parametrize("mode", list(MODES))
def test_mlx_fp_qmv_grid(mode):
    # test_fp_qmv: output rows 256/512/67/5/7, K 64/256, x (3, 1, K); tol 1e-3
    for n in (256, 512, 67, 5, 7):
        for k in (64, 256):
            mlx_case(mode, (3, 1, k), n, k, key=n + k, tol=1e-3)
    if mode == "nvfp4":  # a K that is a multiple of 16, not of 32
        mlx_case(mode, (1, 48), 128, 48, key=1, tol=1e-3)


@pytest.mark.parametrize("mode", list(MODES))
def test_mlx_qmv_wide_grid(mode):
    # test_qmv_wide, fp modes: M 2..9 rows, N 256 and 67, K 128 and 512
    for m in (2, 3, 4, 5, 6, 7, 9):
        for n in (256, 67):
            for k in (128, 512):
                mlx_case(mode, (m, k), n, k, key=m * 100 + n + k, tol=1e-3)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mlx_fp_qmv_unaligned_n_grid(mode, dtype):
    # test_fp_qmv_fast_unaligned_n (MLX runs it on Metal; the CPU here):
    # N 1..17, K 256..1024 including 544, x and w scaled by 1/sqrt(K)
    for n in (1, 3, 5, 7, 8, 9, 12, 17):
        for k in (256, 544, 1024):
            k1, k2 = mx.random.split(mx.random.key(n * 7 + k))
            w = mx.random.normal((n, k), key=k1) / k ** 0.5
            x = (mx.random.normal((1, k), key=k2) / k ** 0.5).astype(dtype)
            wq, s = mx.quantize(w, mode=mode)
            want = x.astype(mx.float32) @ mx.dequantize(wq, s, mode=mode, dtype=mx.float32).T
            got = mixbits.quantized_matmul(x, wq, s, mode=mode)
            assert (got.astype(mx.float32) - want).abs().max().item() < 1e-3


def test_mlx_fp_qmv_large_output_and_tiny():
    # test_fp_qmv_large_output (nvfp4, N 4096, K 512) and the tiny nvfp4 shapes of test_qmv_wide
    mlx_case("nvfp4", (1, 512), 4096, 512, key=0, tol=1e-3, x_div=512 ** 0.5)
    for m, k, n in ((2, 32, 10), (4, 32, 7), (3, 64, 5), (5, 64, 3)):
        mlx_case("nvfp4", (m, k), n, k, key=m + k + n, tol=1e-3)
