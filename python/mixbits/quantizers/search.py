"""Better round-to-nearest: per-group scale/bias search.

Each group keeps whichever of these has the lowest weighted squared error
sum_k h_k (w_k - what_k)^2 (h = diag(X^T X), or ones), measured with the
parameters as stored (rounded to dtype):
  - RTN's own min-max parameters and codes (so no group gets worse);
  - a grid of clipped ranges (both ends shrunk towards zero by p);
  - the group's own grid, where the weight looks decoded from blocks of
    this width (``_grid.on_a_grid``, ``_grid.lattice_params``: a weight
    decoded from K-quant blocks is held exactly, up to the storage dtype's
    rounding of its step and minimum);
  - ``refine`` rounds of the weighted least-squares scale and bias for the
    best codes so far, then re-rounding (a Lloyd step: it can only help,
    and is kept only where it does).
Ternary segments search the absmean scale s the same way (grid of
multiples, then s = sum h w t / sum h t^2 for the chosen t in {-1,0,1}).
Groups are independent given a diagonal weighting, so all are searched at
once; no Hessian inverse, cost a few passes over the weight.

Two implementations with the same results: the numpy one below
(``search_affine``/``search_ternary``, ``search_reference``: the
definition) and the fused kernel of the extension (cpp/quant_search), which
``search`` runs a block of rows at a time: per group every candidate's codes
and error in one pass held in cache, with numpy's float32 steps and its
pairwise float64 sums, so codes, scales and biases are bit-identical
(tests/test_search_fast.py). Only the per-group parameters (clip grid,
rounding to the storage dtype, the least-squares solve) stay in numpy.
"""

from __future__ import annotations

import numpy as np

from .. import _ext
from ..layout import TERNARY
from . import _grid as G

# Elements per block of rows the fused path handles at once: its float32
# target, dtype-rounded copy and uint8 codes (~9 bytes an element) stay a few
# MiB whatever the tensor, and the per-group numpy work stays a small share.
CHUNK_ELEMENTS = 1 << 20


def _err(t, what, h):
    return (h * (t - what) ** 2).sum(axis=-1, dtype=np.float64)


def _keep(best, err, *cand):
    """Per group, take the candidate where it is strictly better."""
    better = err < best[0]
    best[0] = np.where(better, err, best[0])
    for i, c in enumerate(cand, 1):
        m = better[..., None] if c.ndim == better.ndim + 1 else better
        best[i] = np.where(m, c, best[i])


def search_affine(t, h, bits, dtype, grid, refine, lattice=False):
    """t [N, G, gs] float32 target, h [1, G, gs]; returns codes, scale, bias.
    ``lattice``: also try each group's own grid (the weight looks decoded
    from blocks of this width: ``_grid.on_a_grid``)."""
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
    if lattice:
        trial(*G.lattice_params(td, bits))
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
    return _search(w, segments, perm, dtype, h_diag, grid, refine, fast=True)


def search_reference(w, segments, perm=None, dtype=None, h_diag=None, grid=20, refine=2):
    """``search`` computed by the numpy definition (whole segments at once):
    the reference the fused path is tested against."""
    return _search(w, segments, perm, dtype, h_diag, grid, refine, fast=False)


def _search(w, segments, perm, dtype, h_diag, grid, refine, fast, simd=True):
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
    fast = fast and hasattr(_ext, "search_trials")  # an extension built before the kernel
    segs, k0 = [], 0
    for bits, gs, k in specs:
        # The group's own grid is a candidate where the weight looks decoded
        # from blocks of this width (not with grid=0: no search, RTN itself).
        lattice = bool(grid) and bits != TERNARY and G.on_a_grid(W[:, k0 : k0 + k], bits, gs, dtype)
        if fast:
            codes, s, b = _search_fast(W[:, k0 : k0 + k], h[k0 : k0 + k], bits, gs, dtype, grid, refine, simd,
                                       lattice)
        else:
            t = W[:, k0 : k0 + k].reshape(N, k // gs, gs)
            codes, s, b = _by_definition(t, h[k0 : k0 + k].reshape(1, k // gs, gs), bits, dtype, grid, refine,
                                         lattice)
        segs.append(G.segment(bits, gs, codes.reshape(N, k), s, b, dtype))
        k0 += k
    return G.tensor(segs, perm)


def _by_definition(t, hg, bits, dtype, grid, refine, lattice=False):
    """Groups t [N, G, gs] (weights hg [1, G, gs]) searched by the numpy definition."""
    if bits == TERNARY:
        return search_ternary(t, hg, dtype, grid, refine)
    return search_affine(t, hg, bits, dtype, grid, refine, lattice)


def _search_fast(Wk, hk, bits, gs, dtype, grid, refine, simd, lattice=False):
    """One segment's columns Wk [N, k] by the fused kernel, a block of rows
    at a time: codes uint8 [N, G, gs], scales and biases float32 [N, G]."""
    N, k = Wk.shape
    ng = k // gs
    codes = np.empty((N, ng, gs), np.uint8)
    scales = np.empty((N, ng), G.F32)
    biases = np.empty((N, ng), G.F32)
    h = np.ascontiguousarray(hk.reshape(ng, gs), G.F32)
    rows = max(1, CHUNK_ELEMENTS // max(k, 1))
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        t = np.ascontiguousarray(Wk[r0:r1]).reshape(r1 - r0, ng, gs)
        if bits == TERNARY:
            out = _ternary_fast(t, h, dtype, grid, refine, simd)
        else:
            out = _affine_fast(t, h, bits, dtype, grid, refine, simd, lattice)
        if out is None:  # outside the storage dtype's range: the definition decides
            out = _by_definition(t, h.reshape(1, ng, gs), bits, dtype, grid, refine, lattice)
            if not np.isfinite(out[0]).all():  # where the definition has no codes, neither has this
                raise ValueError(f"w has values beyond {dtype}'s range: no {bits}-bit codes for them")
        codes[r0:r1], scales[r0:r1], biases[r0:r1] = out
    return codes, scales, biases


class _Best:
    """The fused kernel's running choice over a block: per group the best
    error, the index of its candidate, its codes, and that candidate's
    decode scale and bias."""

    def __init__(self, t, x, h, qlo, qhi, qoff, simd):
        self.t, self.x, self.h, self.simd = t, x, h, simd
        self.q = (float(qlo), float(qhi), float(qoff))
        n = t.shape[0] * t.shape[1]
        self.err = np.empty(n, np.float64)
        self.idx = np.full(n, -1, np.int32)
        self.codes = np.empty(t.shape, np.uint8)
        self.scale = np.zeros(n, G.F32)
        self.bias = np.zeros(n, G.F32)
        self.count = 0

    def trials(self, cs, cb, ds, db):
        """Candidates [C, n] (code scale, code bias, decode scale, bias)."""
        c = [np.ascontiguousarray(np.broadcast_to(a, ds.shape), G.F32) for a in (cs, cb, ds, db)]
        _ext.search_trials(self.t, self.x, self.h, *c, *self.q, self.count, self.err, self.idx, self.codes, self.simd)
        new = np.flatnonzero(self.idx >= self.count)  # groups whose choice is one of these
        row = self.idx[new] - self.count
        self.scale[new], self.bias[new] = c[2][row, new], c[3][row, new]
        self.count += c[2].shape[0]

    def chosen(self):
        """Decode scale and bias of each group's kept candidate [n]."""
        return self.scale, self.bias

    def lsq_sums(self):
        """Per group sum h, h q, h q q, h t, h q t of the kept codes' levels q."""
        out = np.empty((self.idx.shape[0], 5), np.float64)
        _ext.search_lsq_sums(self.t, self.h, self.codes, -self.q[2], out, self.simd)  # q: the level, code - qoff
        return out.T


def _affine_fast(t, h, bits, dtype, grid, refine, simd, lattice=False):
    """search_affine on a block t [n, G, gs] through the fused kernel; the
    per-group parameters are computed exactly as there (elementwise, so the
    same float32/float64 values), or None where the dtype overflows."""
    nb = 2**bits - 1
    n, ng, gs = t.shape
    td = G.to_dtype(t, dtype)
    if not np.isfinite(td).all():
        return None
    best = _Best(t, np.ascontiguousarray(td), h, 0, nb, 0, simd)
    lo, hi = td.min(axis=-1).reshape(1, -1), td.max(axis=-1).reshape(1, -1)
    s, b = G.minmax_from_range(lo, hi, bits)
    best.trials(s, b, G.to_dtype(s, dtype), G.to_dtype(b, dtype))

    def sanitize(scale, bias):  # as search_affine's trial
        scale = np.where(np.abs(scale) < 1e-7, np.float32(1e-7), scale)
        s_d, b_d = G.to_dtype(scale, dtype), G.to_dtype(bias, dtype)
        s_d = np.where(s_d == 0, np.float32(1e-7), s_d)
        return s_d, b_d

    if grid:
        p = np.linspace(1.0, 0.5, grid + 1, dtype=np.float32)[1:, None]
        lo_p, hi_p = np.where(lo < 0, lo * p, lo), np.where(hi > 0, hi * p, hi)
        s_d, b_d = sanitize(((hi_p - lo_p) / np.float32(nb)).astype(G.F32), lo_p.astype(G.F32))
        best.trials(s_d, b_d, s_d, b_d)
    if lattice:
        s_d, b_d = sanitize(*(a.reshape(1, -1) for a in G.lattice_params(td, bits)))
        best.trials(s_d, b_d, s_d, b_d)
    for _ in range(refine):
        b_s, b_b = best.chosen()
        sh, sq, sqq, sw, sqw = best.lsq_sums()
        det = sh * sqq - sq * sq
        ok = det > 1e-12 * np.maximum(sh * sqq, 1e-300)
        scale = np.where(ok, (sh * sqw - sq * sw) / np.where(ok, det, 1), b_s)
        bias = np.where(ok, (sw - scale * sq) / np.where(sh > 0, sh, 1), b_b)
        s_d, b_d = sanitize(scale.astype(G.F32)[None], bias.astype(G.F32)[None])
        best.trials(s_d, b_d, s_d, b_d)
    b_s, b_b = best.chosen()
    return best.codes, b_s.reshape(n, ng), b_b.reshape(n, ng)


def _ternary_fast(t, h, dtype, grid, refine, simd):
    """search_ternary on a block t [n, G, gs] through the fused kernel."""
    n, ng, gs = t.shape
    best = _Best(t, t, h, -1, 1, 1, simd)
    s0 = G.ternary_scale(t).reshape(1, -1)
    s_d = G.to_dtype(s0, dtype)
    if not (np.isfinite(s0).all() and np.isfinite(s_d).all()):
        return None
    best.trials(s0, np.float32(0), s_d, -s_d)

    def trial(s):  # as search_ternary's trial, one candidate row [1, n]
        s_d = G.to_dtype(np.maximum(s, np.float32(1e-7)), dtype)
        s_d = np.where(s_d > 0, s_d, best.chosen()[0][None])
        best.trials(s_d, np.float32(0), s_d, -s_d)

    if grid:
        m = np.linspace(0.5, 1.5, grid + 1, dtype=np.float32)
        s = (s0 * m[m != 1][:, None]).astype(G.F32)
        s_d = G.to_dtype(np.maximum(s, np.float32(1e-7)), dtype)
        if (s_d > 0).all():  # always, for finite s: then all candidates in one call
            best.trials(s_d, np.float32(0), s_d, -s_d)
        else:
            for row in s:
                trial(row[None])
    for _ in range(refine):
        b_s = best.chosen()[0]
        _, _, den, _, num = best.lsq_sums()
        ok = (den > 0) & (num > 0)
        trial(np.where(ok, num / np.where(ok, den, 1), b_s).astype(G.F32)[None])
    b_s = best.chosen()[0].reshape(n, ng)
    return best.codes, b_s, -b_s
