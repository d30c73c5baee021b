"""Better round-to-nearest: per-group scale/bias search.

Each group keeps whichever of these has the lowest weighted squared error
sum_k h_k (w_k - what_k)^2 (h = diag(X^T X), or ones), measured with the
parameters as stored (rounded to dtype):
  - RTN's own min-max parameters and codes (so no group gets worse);
  - a grid of clipped ranges (both ends shrunk towards zero by p);
  - ``refine`` rounds of the weighted least-squares scale and bias for the
    best codes so far, then re-rounding (a Lloyd step: it can only help,
    and is kept only where it does).
Ternary segments search the absmean scale s the same way (grid of
multiples, then s = sum h w t / sum h t^2 for the chosen t in {-1,0,1}).
Groups are independent given a diagonal weighting, so all are searched at
once; no Hessian inverse, cost a few passes over the weight.
"""

from __future__ import annotations

import numpy as np

from ..layout import TERNARY
from . import _grid as G


def _err(t, what, h):
    return (h * (t - what) ** 2).sum(axis=-1, dtype=np.float64)


def _keep(best, err, *cand):
    """Per group, take the candidate where it is strictly better."""
    better = err < best[0]
    best[0] = np.where(better, err, best[0])
    for i, c in enumerate(cand, 1):
        m = better[..., None] if c.ndim == better.ndim + 1 else better
        best[i] = np.where(m, c, best[i])


def search_affine(t, h, bits, dtype, grid, refine):
    """t [N, G, gs] float32 target, h [1, G, gs]; returns codes, scale, bias."""
    nb = 2**bits - 1
    td = G.to_dtype(t, dtype)  # RTN quantizes w as rounded to dtype
    s, b = G.minmax_params(td, bits)
    codes = G.affine_codes(td, s[..., None], b[..., None], bits)
    s_d, b_d = G.to_dtype(s, dtype), G.to_dtype(b, dtype)
    best = [_err(t, G.decode(codes, s_d[..., None], b_d[..., None]), h), codes, s_d, b_d]

    def trial(scale, bias):
        scale = np.where(np.abs(scale) < 1e-7, np.float32(1e-7), scale)
        s_d, b_d = G.to_dtype(scale, dtype), G.to_dtype(bias, dtype)
        s_d = np.where(s_d == 0, np.float32(1e-7), s_d)  # underflow in fp16
        c = G.affine_codes(td, s_d[..., None], b_d[..., None], bits)
        _keep(best, _err(t, G.decode(c, s_d[..., None], b_d[..., None]), h), c, s_d, b_d)

    lo, hi = td.min(axis=-1), td.max(axis=-1)
    for p in np.linspace(1.0, 0.5, grid + 1, dtype=np.float32)[1:]:
        lo_p, hi_p = np.where(lo < 0, lo * p, lo), np.where(hi > 0, hi * p, hi)
        trial(((hi_p - lo_p) / np.float32(nb)).astype(G.F32), lo_p.astype(G.F32))
    h64, t64 = np.broadcast_to(h, t.shape).astype(np.float64), t.astype(np.float64)
    for _ in range(refine):
        q = best[1].astype(np.float64)
        sh, sq, sqq = h64.sum(-1), (h64 * q).sum(-1), (h64 * q * q).sum(-1)
        sw, sqw = (h64 * t64).sum(-1), (h64 * q * t64).sum(-1)
        det = sh * sqq - sq * sq
        ok = det > 1e-12 * np.maximum(sh * sqq, 1e-300)
        scale = np.where(ok, (sh * sqw - sq * sw) / np.where(ok, det, 1), best[2])
        bias = np.where(ok, (sw - scale * sq) / np.where(sh > 0, sh, 1), best[3])
        trial(scale.astype(G.F32), bias.astype(G.F32))
    return best[1], best[2], best[3]


def search_ternary(t, h, dtype, grid, refine):
    s0 = G.ternary_scale(t)
    codes = G.ternary_codes(t, s0[..., None])
    s_d = G.to_dtype(s0, dtype)
    best = [_err(t, G.decode(codes, s_d[..., None], -s_d[..., None]), h), codes, s_d]

    def trial(s):
        s_d = G.to_dtype(np.maximum(s, np.float32(1e-7)), dtype)
        s_d = np.where(s_d > 0, s_d, best[2])
        c = G.ternary_codes(t, s_d[..., None])
        _keep(best, _err(t, G.decode(c, s_d[..., None], -s_d[..., None]), h), c, s_d)

    for m in np.linspace(0.5, 1.5, grid + 1, dtype=np.float32) if grid else ():
        if m != 1:
            trial((s0 * m).astype(G.F32))
    h64 = np.broadcast_to(h, t.shape).astype(np.float64)
    for _ in range(refine):
        q = best[1].astype(np.float64) - 1
        den = (h64 * q * q).sum(-1)
        num = (h64 * q * t).sum(-1)
        ok = (den > 0) & (num > 0)
        trial(np.where(ok, num / np.where(ok, den, 1), best[2]).astype(G.F32))
    return best[1], best[2], -best[2]


def search(w, segments, perm=None, dtype=None, h_diag=None, grid=20, refine=2):
    """Quantize ``w`` [N, K] into ``segments`` (as ``layout.quantize``),
    choosing each group's scale and bias to minimise
    sum_k h_k (w - what)^2 with ``h_diag`` = diag(X^T X) of the layer input
    (K,) in original column order (default: ones, plain squared error).
    ``grid``: clip ratios tried (affine: range shrunk to 1 .. 0.5;
    ternary: absmean times 0.5 .. 1.5). ``refine``: least-squares rounds.
    Every group's weighted error is <= RTN's for that group.
    """
    W, dtype = G.as_weight(w, dtype)
    N, K = W.shape
    specs = G.check_segments(segments, K)
    perm = G.check_perm(perm, K)
    h = np.ones(K) if h_diag is None else G.check_vector("h_diag", h_diag, K)
    for name, v in (("grid", grid), ("refine", refine)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    if perm is not None:
        W, h = W[:, perm], h[perm]
    h = (h / h.max() if h.max() > 0 else h).astype(G.F32)  # scale-free, float32 safe
    segs, k0 = [], 0
    for bits, gs, k in specs:
        t = W[:, k0 : k0 + k].reshape(N, k // gs, gs)
        hg = h[k0 : k0 + k].reshape(1, k // gs, gs)
        if bits == TERNARY:
            codes, s, b = search_ternary(t, hg, dtype, grid, refine)
        else:
            codes, s, b = search_affine(t, hg, bits, dtype, grid, refine)
        segs.append(G.segment(bits, gs, codes.reshape(N, k), s, b, dtype))
        k0 += k
    return G.tensor(segs, perm)
