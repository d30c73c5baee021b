"""Independent references for kernel tests: MLX's own dequantize, then
float64 numpy matmul; causal attention, SwiGLU and their derivatives in
float64 numpy. Nothing here uses mixbits' kernels or packing."""

import mlx.core as mx
import numpy as np


def dequantize_f64(qt) -> np.ndarray:
    """Dense float64 [N, K] in stored (permuted) order via mx.dequantize."""
    parts = []
    for s in qt.segments:
        w = mx.dequantize(s.wq, s.scales.astype(mx.float32), s.biases.astype(mx.float32),
                          group_size=s.group_size, bits=s.bits)
        parts.append(np.array(w, dtype=np.float64))
    return np.concatenate(parts, axis=1)


def to_f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


def qmatmul_f64(x: mx.array, qt):
    """(reference y, error bound scale) for x @ W.T with W = qt (float64)."""
    xf = to_f64(x)
    if qt.perm is not None:
        xf = xf[..., np.array(qt.perm)]
    w = dequantize_f64(qt)
    return xf @ w.T, np.abs(xf) @ np.abs(w).T


OUT_EPS = {mx.float32: 2.0**-23, mx.float16: 2.0**-10, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}


def assert_matmul_close(y: mx.array, ref: np.ndarray, mag: np.ndarray, acc_rtol: float = 2e-5):
    """|y - ref| <= acc_rtol * sum|x||w| (float32 accumulation) + output rounding."""
    got = to_f64(y)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.isfinite(got).all()
    tol = acc_rtol * mag + 2 * OUT_EPS[y.dtype] * np.abs(ref) + 1e-30
    bad = np.abs(got - ref) > tol
    if bad.any():
        i = np.argwhere(bad)[0]
        raise AssertionError(
            f"{bad.sum()} of {bad.size} outputs off; first at {tuple(i)}: "
            f"got {got[tuple(i)]}, want {ref[tuple(i)]}, tol {tol[tuple(i)]}")


def attention64(q, k, v, scale):
    """softmax(scale q k^T, causal with the queries last) v in float64."""
    q, k, v = (np.array(a).astype(np.float64) for a in (q, k, v))
    B, H, T, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    k = np.repeat(k, H // Hk, axis=1)
    v = np.repeat(v, H // Hk, axis=1)
    s = scale * q @ k.transpose(0, 1, 3, 2)
    allowed = np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T)
    s = np.where(allowed, s, -np.inf)
    s -= s.max(-1, keepdims=True)
    p = np.exp(s)
    return (p / p.sum(-1, keepdims=True)) @ v


def attention_vjp64(q, k, v, dout, scale):
    """(dq, dk, dv) of softmax(scale q k^T, causal, queries last) v in float64;
    the query heads of a group share (and add into) one KV head."""
    q, k, v, do = (np.array(a).astype(np.float64) for a in (q, k, v, dout))
    B, H, T, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    r = H // Hk
    kr, vr = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)
    s = scale * q @ kr.transpose(0, 1, 3, 2)
    allowed = np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T)
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = do @ vr.transpose(0, 1, 3, 2)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    dq = scale * ds @ kr
    dk = (scale * ds.transpose(0, 1, 3, 2) @ q).reshape(B, Hk, r, S, D).sum(2)
    dv = (p.transpose(0, 1, 3, 2) @ do).reshape(B, Hk, r, S, D).sum(2)
    return dq, dk, dv


def swiglu_vjp64(g, u, dy):
    g, u, dy = (np.array(a).astype(np.float64) for a in (g, u, dy))
    with np.errstate(over="ignore", invalid="ignore"):
        s = 1 / (1 + np.exp(-g))
        return dy * u * s * (1 + g * (1 - s)), dy * g * s
