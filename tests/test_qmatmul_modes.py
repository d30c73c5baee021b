"""mixbits.quantized_matmul / gather_quantized_matmul with MLX's ``mode=``
and ``transpose=`` arguments: every mode and both orientations agree with
the float64 product of ``mx.dequantize``'s weight and with MLX's own op.
Affine with transpose=True runs mixbits' kernel, and so do the fp modes on
the CPU (either transpose: tests/test_fp_modes_kernel.py); affine
transpose=False runs MLX's op."""

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from mixbits.errors import UsageError

# mode -> (group_size, bits) as MLX fixes or defaults them (help(mx.quantize)).
MODES = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
DTYPES = [mx.float32, mx.float16, mx.bfloat16]
# Relative to the product's scale: the output's rounding in its dtype plus
# MLX's accumulation order in half precision.
TOL = {mx.float32: 2e-5, mx.float16: 1e-2, mx.bfloat16: 5e-2}


def _quantized(rng, shape, mode, dtype):
    gs, bits = MODES[mode]
    w = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    q = mx.quantize(w, group_size=gs, bits=bits, mode=mode)
    wq, s = q[0], q[1]
    b = q[2] if mode == "affine" else None
    w64 = np.array(mx.dequantize(wq, s, b, group_size=gs, bits=bits, mode=mode, dtype=mx.float32),
                   dtype=np.float64)
    return wq, s, b, w64


def _check(got, want, ref64, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype
    g = np.array(got.astype(mx.float32), dtype=np.float64)
    scale = np.abs(ref64).max() + 1e-30
    assert np.abs(g - ref64).max() / scale < TOL[dtype]
    # MLX's op is held to the same bound, so the two are within twice it
    # (MLX accumulates half-precision products differently from mixbits).
    w = np.array(want.astype(mx.float32), dtype=np.float64)
    assert np.abs(w - ref64).max() / scale < TOL[dtype]
    assert np.abs(g - w).max() / scale < 2 * TOL[dtype]


# (x's leading shape, M, N, K): MLX's test_quantized grid in small (a
# vector, a batch of rows, an odd M, batch dims on x); N and K multiples
# of 64, every mode's group size (transpose=False groups along N).
SHAPES = [((), 1, 64, 64), ((), 8, 192, 128), ((), 33, 64, 256), ((2,), 3, 128, 128)]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("lead,M,N,K", SHAPES)
def test_quantized_matmul_modes(mode, dtype, transpose, lead, M, N, K):
    rng = np.random.default_rng(M * 7 + N + K)
    gs, bits = MODES[mode]
    # transpose=True: W is (N, K), y = x @ W.T; False: W is (K, N), y = x @ W.
    wq, s, b, w64 = _quantized(rng, (N, K) if transpose else (K, N), mode, dtype)
    x = mx.array(rng.standard_normal((*lead, M, K)).astype(np.float32)).astype(dtype)
    x64 = np.array(x.astype(mx.float32), dtype=np.float64)
    ref64 = x64 @ (w64.T if transpose else w64)
    got = mixbits.quantized_matmul(x, wq, s, b, group_size=gs, bits=bits, transpose=transpose, mode=mode)
    want = mx.quantized_matmul(x, wq, s, b, transpose=transpose, group_size=gs, bits=bits, mode=mode)
    _check(got, want, ref64, dtype)
    # MLX's defaults for the mode when group_size / bits are left out.
    again = mixbits.quantized_matmul(x, wq, s, b, transpose=transpose, mode=mode)
    assert mx.array_equal(again, got).item()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("transpose", [True, False])
def test_gather_quantized_matmul_modes(mode, dtype, transpose):
    rng = np.random.default_rng(3)
    gs, bits = MODES[mode]
    E, N, K, M = 4, 64, 128, 2
    wq, s, b, w64 = _quantized(rng, (E, N, K) if transpose else (E, K, N), mode, dtype)
    x = mx.array(rng.standard_normal((5, 1, M, K)).astype(np.float32)).astype(dtype)
    rhs = mx.array(np.array([[3], [0], [2], [2], [1]], dtype=np.uint32))
    x64 = np.array(x.astype(mx.float32), dtype=np.float64)
    w_sel = w64[np.array(rhs).reshape(-1)]  # (5, N, K) or (5, K, N)
    ref64 = np.stack([x64[i, 0] @ (w_sel[i].T if transpose else w_sel[i]) for i in range(5)])[:, None]
    got = mixbits.gather_quantized_matmul(x, wq, s, b, None, rhs, group_size=gs, bits=bits,
                                          transpose=transpose, mode=mode)
    want = mx.gather_qmm(x, wq, s, b, None, rhs, transpose=transpose, group_size=gs, bits=bits, mode=mode)
    _check(got, want, ref64, dtype)


def test_affine_transposed_runs_mixbits_kernel(monkeypatch):
    """The route: affine with transpose=True is mixbits' affine kernel; the
    fp modes are not (their CPU kernel: test_fp_modes_kernel's routing
    test), and affine transpose=False is MLX's op."""
    from mixbits import ops

    calls = []
    monkeypatch.setattr(ops, "qmatmul", lambda *a, **k: calls.append("mixbits") or mx.zeros((1, 8)))
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, 64)).astype(np.float32))
    for mode in MODES:
        wq, s, b, _ = _quantized(rng, (8, 64), mode, mx.float32)
        mixbits.quantized_matmul(x, wq, s, b, mode=mode)
    wq, s, b, _ = _quantized(rng, (64, 64), "affine", mx.float32)
    mixbits.quantized_matmul(x, wq, s, b, transpose=False)
    assert calls == ["mixbits"]


def test_mode_errors_are_mlx_types():
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((1, 64)).astype(np.float32))
    wq, s, b, _ = _quantized(rng, (8, 64), "mxfp4", mx.float32)
    with pytest.raises(ValueError, match="mode must be one of"):
        mixbits.quantized_matmul(x, wq, s, mode="fp4")
    with pytest.raises(TypeError, match="mode must be a str"):
        mixbits.quantized_matmul(x, wq, s, mode=4)
    with pytest.raises(TypeError, match="transpose must be a bool"):
        mixbits.quantized_matmul(x, wq, s, mode="mxfp4", transpose=1)
    with pytest.raises(ValueError, match="Biases must be null"):  # MLX's own check
        mixbits.quantized_matmul(x, wq, s, s, mode="mxfp4")
    with pytest.raises(ValueError, match="group size|incompatible"):
        mixbits.quantized_matmul(x, wq, s, group_size=64, mode="mxfp4")
    with pytest.raises(UsageError, match="has none"):
        mixbits.quantized_matmul(x, wq, s, mode="mxfp4", activations="int8")
    with pytest.raises(UsageError, match="has none"):
        mixbits.gather_quantized_matmul(x, wq, s, mode="mxfp4", backend="ref")
    aq, a_s, a_b, _ = _quantized(rng, (8, 64), "affine", mx.float32)
    with pytest.raises(ValueError, match="biases must be provided"):
        mixbits.quantized_matmul(x, aq, a_s, None)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("transpose", [True, False])
def test_gradient_wrt_x(mode, transpose):
    """d/dx sum(c * (x @ W^T)) = c @ W (transpose=False: c @ W^T), against
    float64 of the dequantized weight, for routed and kernel calls alike."""
    rng = np.random.default_rng(9)
    gs, bits = MODES[mode]
    wq, s, b, w64 = _quantized(rng, (64, 128) if transpose else (128, 64), mode, mx.float32)
    k = 128
    x = mx.array(rng.standard_normal((3, k)).astype(np.float32))
    c = mx.array(rng.standard_normal((3, 64)).astype(np.float32))
    f = lambda x: (c * mixbits.quantized_matmul(x, wq, s, b, transpose=transpose, mode=mode)).sum()
    got = np.array(mx.grad(f)(x), dtype=np.float64)
    c64 = np.array(c, dtype=np.float64)
    want = c64 @ (w64 if transpose else w64.T)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
