"""Shared pieces of the calibrated quantizers: input checks, MLX's own
min-max rule replicated in numpy, code selection, and packing into the
standard layout.

Codes are chosen exactly as ``mx.quantize`` / ``layout.ternary_triplet``
choose them (float32 parameters before rounding to the storage dtype), so a
quantizer whose search or error feedback has nothing to do reproduces RTN
bit for bit; reconstruction errors are measured with the parameters as
stored (rounded to ``dtype``), since that is what the kernels decode.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import layout
from ..layout import FLOAT_DTYPES, TERNARY, QuantizedTensor, Segment, pack_codes, segment_spec

F32 = np.float32


def as_weight(w, dtype):
    """``w`` as a float32 numpy [N, K] and the storage dtype (default: w's
    float dtype, as ``layout.quantize``)."""
    if isinstance(w, mx.array):
        if w.dtype not in FLOAT_DTYPES:
            raise ValueError(f"w must be float32/float16/bfloat16, got {w.dtype}")
        dtype = dtype or w.dtype
        wn = np.array(w.astype(mx.float32))
    else:
        wn = np.asarray(w)
        if not np.issubdtype(wn.dtype, np.floating):
            raise ValueError(f"w must be a float array, got dtype {wn.dtype}")
        dtype = dtype or (mx.float16 if wn.dtype == np.float16 else mx.float32)
        wn = wn.astype(F32)
    if wn.ndim != 2:
        raise ValueError(f"w must be 2-D [N, K], got shape {wn.shape}")
    if not np.isfinite(wn).all():
        raise ValueError("w has NaN or infinite values")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be float32/float16/bfloat16, got {dtype}")
    return wn, dtype


def check_segments(segments, k_total: int) -> list[tuple]:
    specs = [segment_spec(s, i) for i, s in enumerate(segments)]
    if not specs:
        raise ValueError("segments must not be empty")
    if sum(k for _, _, k in specs) != k_total:
        raise ValueError(f"segment columns sum to {sum(k for _, _, k in specs)} but w has K={k_total}")
    return specs


def check_perm(perm, k_total: int):
    return None if perm is None else np.array(layout.check_perm(perm, k_total)).astype(np.int64)


def check_vector(name: str, v, k_total: int, nonneg=True) -> np.ndarray:
    a = np.asarray(v, dtype=np.float64)
    if a.shape != (k_total,):
        raise ValueError(f"{name} must have shape ({k_total},), got {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} has NaN or infinite values")
    if nonneg and (a < 0).any():
        raise ValueError(f"{name} must be >= 0")
    return a


def to_dtype(x: np.ndarray, dtype) -> np.ndarray:
    """float32 values rounded through the storage dtype (round to nearest
    even, as MLX casts), back in float32."""
    x = np.asarray(x, dtype=F32)
    if dtype == mx.float32:
        return x
    if dtype == mx.float16:
        return x.astype(np.float16).astype(F32)
    u = np.ascontiguousarray(x).view(np.uint32)  # bfloat16: keep the high half, RNE
    u = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return u.view(F32)


def minmax_params(g: np.ndarray, bits: int):
    """MLX's affine rule on float32 groups [..., gs]: the range over
    2**bits - 1 steps, nudged so the edge of larger magnitude is a code
    exactly (the scale may come out negative; that is MLX's convention)."""
    return minmax_from_range(g.min(axis=-1), g.max(axis=-1), bits)


def minmax_from_range(lo: np.ndarray, hi: np.ndarray, bits: int):
    """minmax_params from the groups' float32 minimum and maximum."""
    nb = F32(2**bits - 1)
    low_edge = np.abs(lo) > np.abs(hi)
    scale = np.maximum((hi - lo) / nb, F32(1e-7))
    scale = np.where(low_edge, scale, -scale)
    edge = np.where(low_edge, lo, hi)
    q0 = np.rint(edge / scale)
    nz = q0 != 0
    scale = np.where(nz, edge / np.where(nz, q0, F32(1)), scale).astype(F32)
    bias = np.where(nz, edge, F32(0)).astype(F32)
    return scale, bias


def lattice_params(g: np.ndarray, bits: int):
    """Scale and bias [..., G] that hold a group g [..., G, gs] exactly
    when its values sit on an evenly spaced grid of at most 2**bits levels
    -- a weight decoded from a K-quant block (d*sc*q - dmin*m), whose
    extreme codes a group need not use, so min-max spreads its range over
    every level and moves all of them. The bias is the minimum, the step
    the range over the number of steps it spans: each gap between sorted
    values above half of min-max's step counted as the whole number of
    smallest such gaps nearest to it (a grid's gaps are multiples of its
    step). Counting gap by gap keeps the count right where the rounding of
    the values (to float16, say) moves the smallest gap by a share that,
    times the 63 steps of a 6-bit range, would miscount it. On other
    groups this is one more candidate the search keeps only where it is
    better."""
    nb = 2**bits - 1
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    gaps = np.diff(np.sort(g, axis=-1), axis=-1)
    big = gaps > ((hi - lo) / F32(2 * nb))[..., None]
    smallest = np.where(big, gaps, np.inf).min(axis=-1, keepdims=True)
    steps = np.where(big, np.maximum(np.rint(gaps / smallest), 1), 0).sum(axis=-1)
    step = np.where(steps > 0, (hi - lo) / np.maximum(steps, 1), (hi - lo) / F32(nb))  # one value: min-max's
    return step.astype(F32), lo.astype(F32)


def on_a_grid(w: np.ndarray, bits: int, gs: int, dtype, rows: int = 16) -> bool:
    """Whether the columns ``w`` [N, k] look decoded from blocks of ``bits``
    codes per ``gs``: on up to ``rows`` evenly spread rows, the grid of
    :func:`lattice_params` holds at least half of the groups with under
    1% of min-max's squared error. The search tries that grid on every
    group only then: a float weight almost never sits on one, and sorting
    every group would add half to the search's time."""
    n, k = w.shape
    t = w[:: max(1, n // rows)][:rows].reshape(-1, k // gs, gs)
    td = to_dtype(t, dtype)
    if not np.isfinite(td).all():
        return False

    def err(scale, bias):
        s_d, b_d = to_dtype(scale, dtype)[..., None], to_dtype(bias, dtype)[..., None]
        s_d = np.where(s_d == 0, F32(1e-7), s_d)
        return ((decode(affine_codes(td, s_d, b_d, bits), s_d, b_d) - t) ** 2).sum(axis=-1, dtype=np.float64)

    lattice, minmax = err(*lattice_params(td, bits)), err(*minmax_params(td, bits))
    return bool(np.mean(lattice < 0.01 * minmax) >= 0.5)


def affine_codes(w, scale, bias, bits: int) -> np.ndarray:
    return np.clip(np.rint((w - bias) / scale), 0, 2**bits - 1)


def ternary_scale(g: np.ndarray) -> np.ndarray:
    """absmean of float32 groups [..., gs] (zero groups get 1: any code 1
    decodes to 0), as ``layout.ternary_triplet``."""
    s = np.abs(g).mean(axis=-1)
    return np.where(s > 0, s, 1.0).astype(F32)


def ternary_codes(w, s) -> np.ndarray:
    return np.clip(np.rint(w / s), -1, 1) + 1


def decode(codes, scale_d, bias_d) -> np.ndarray:
    """The reconstruction with stored (dtype-rounded) parameters, float32."""
    return (scale_d * codes.astype(F32) + bias_d).astype(F32)


def segment(bits, gs: int, codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, dtype) -> Segment:
    """A Segment from integer codes [N, k] and per-group parameters [N, k/gs]
    already rounded to ``dtype``."""
    kind = "ternary" if bits == TERNARY else "affine"
    b = 2 if bits == TERNARY else bits
    if codes.dtype == np.uint8 and codes.shape[1] % 32 == 0 and codes.size and int(codes.max()) < 1 << b:
        wq = mx.array(pack_u8(codes, b))
    else:
        wq = mx.array(pack_codes(codes.astype(np.int64), b))
    sc = mx.array(np.asarray(scales, F32)).astype(dtype)
    bi = mx.array(np.asarray(biases, F32)).astype(dtype)
    return Segment(b, gs, codes.shape[1], wq, sc, bi, kind)


def pack_u8(codes: np.ndarray, bits: int, rows: int = 4096) -> np.ndarray:
    """``layout.pack_codes`` for uint8 codes [N, k] (k % 32 == 0, codes <
    2**bits): each 32 codes fill ``bits`` words, code j from stream bit
    j*bits; one shift-or per code position over a block of rows, instead of
    a bit plane per bit (same words; tests/test_search_fast.py)."""
    n, k = codes.shape
    out = np.zeros((n, k // 32, bits), np.uint32)
    for r0 in range(0, n, rows):
        c = codes[r0 : r0 + rows].reshape(-1, k // 32, 32)
        o = out[r0 : r0 + rows]
        for j in range(32):
            word, shift = divmod(j * bits, 32)
            v = c[:, :, j].astype(np.uint32)
            o[:, :, word] |= v << np.uint32(shift)
            if shift + bits > 32:
                o[:, :, word + 1] |= v >> np.uint32(32 - shift)
    return out.reshape(n, k // 32 * bits)


def tensor(segs, perm) -> QuantizedTensor:
    return QuantizedTensor(segs, None if perm is None else perm.astype(np.int32))
