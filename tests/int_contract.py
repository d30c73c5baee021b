"""The integer-activation contracts (activations="int8"/"int16") as an
independent numpy model, shared by the tests of every layout that runs them
(tests/test_qmatmul_int8.py: MLX's layout; tests/test_repack.py: the
row-interleaved one): float32 quantization of x, codes from MLX's own
dequantize, exact float64 sums."""

import mlx.core as mx
import numpy as np

import mixbits
from reference import to_f64

# contract -> (Q, the smallest group max|x| that is not counted as zero)
CONTRACTS = {"int8": (127, np.float32(2.0**-119)), "int16": (32767, np.float32(2.0**-111))}


# ---------------------------------------------------------------- numpy model


def codes_scales_biases(qt):
    """Per segment: codes (float64 [N, k], via mx.dequantize with scale 1 and
    bias 0), scales and biases (float64 [N, groups])."""
    out = []
    for s in qt.segments:
        ng = s.k // s.group_size
        ones = mx.ones((s.wq.shape[0], ng), mx.float32)
        q = mx.dequantize(s.wq, ones, mx.zeros_like(ones), group_size=s.group_size, bits=s.bits)
        out.append((np.array(q, np.float64), to_f64(s.scales), to_f64(s.biases)))
    return out


def contract_model(x, qt, act):
    """The contract `act` in numpy: returns (Y* exact contract value, x_hat,
    per-segment d, mag2 = sum (|w| + 2|b|) |x_hat|) for x float32 [M, K]."""
    Q, min_amax = CONTRACTS[act]
    xf = np.array(x.astype(mx.float32), np.float32).reshape(-1, qt.shape[1])
    if qt.perm is not None:
        xf = xf[:, np.array(qt.perm)]
    M = xf.shape[0]
    y = np.zeros((M, qt.shape[0]))
    mag2 = np.zeros_like(y)
    xhat, ds, k0 = [], [], 0
    for s, (q, sc, bi) in zip(qt.segments, codes_scales_biases(qt)):
        G = s.group_size
        g = xf[:, k0:k0 + s.k].reshape(M, -1, G)
        amax = np.abs(g).max(-1)
        ok = amax >= min_amax
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            d = np.where(ok, amax / np.float32(Q), np.float32(0)).astype(np.float32)
            inv = np.where(ok, np.float32(Q) / amax, np.float32(0)).astype(np.float32)
        xq = np.clip(np.rint(g * inv[..., None]), -Q, Q)  # float32 product, half-even
        xh = (xq * d[..., None].astype(np.float64)).reshape(M, s.k)
        w = (q.reshape(q.shape[0], -1, G) * sc[..., None] + bi[..., None]).reshape(q.shape[0], s.k)
        babs = np.repeat(np.abs(bi), G, axis=1)
        y += xh @ w.T
        mag2 += np.abs(xh) @ (np.abs(w) + 2 * babs).T
        xhat.append(xh)
        ds.append(np.repeat(d, G, axis=1).astype(np.float64))
        k0 += s.k
    return y, np.concatenate(xhat, 1), np.concatenate(ds, 1), mag2, xf.astype(np.float64)


def rand_qt(rng, n, segs, perm=False, dtype=mx.float16):
    K = sum(k for _, _, k in segs)
    w = mx.array(rng.standard_normal((n, K)).astype(np.float32)).astype(dtype)
    return mixbits.quantize(w, segs, perm=rng.permutation(K) if perm else None)


def poison_padding(rng, rt, scale=1.0):
    """A copy of RepackedTensor ``rt`` whose last block's padding rows hold
    garbage (random code words; scales and biases normal times ``scale``)
    instead of the zeros the builder writes: kernels must never store them."""
    from mixbits.repack import REPACK_ROWS, RepackedTensor

    n = rt.shape[0]
    assert n % REPACK_ROWS, "no padding rows to poison"
    pad = slice(n - (n - 1) // REPACK_ROWS * REPACK_ROWS, None)  # lanes past the real rows
    segs = []
    for s in rt.segments:
        arrs = []
        for a in (s.wq_r, s.scales_r, s.biases_r):
            words = a.dtype == mx.uint32
            b = np.array(a if words else a.astype(mx.float32))
            shape = b[-1, :, pad].shape
            b[-1, :, pad] = (rng.integers(0, 2**32, shape, dtype=np.uint64) if words
                             else scale * rng.standard_normal(shape))
            arrs.append(mx.array(b.astype(np.uint32)) if words else mx.array(b).astype(a.dtype))
        segs.append(type(s)(s.bits, s.group_size, s.k, *arrs, s.kind))
    return RepackedTensor(segs, rt.perm, n)
