"""GPTQ / OBQ error feedback onto mixbits K-segments.

Columns are quantized one at a time in stored (permuted) order; each
column's rounding error, scaled by the Cholesky factor of the inverse
Hessian, is pushed onto the columns not yet quantized, so they compensate
for it on the calibration inputs. With ``act_order`` the order is diag(H)
descending and *is* the stored perm: the first K-segment (the widest, by the
codec's convention) gets the most salient input channels, as EXL2 does.
"""

from __future__ import annotations

import warnings

import numpy as np
import scipy.linalg

from ..layout import TERNARY
from . import _grid as G
from .search import search_affine, search_ternary


def check_hessian(H, k_total: int) -> np.ndarray:
    """H as a float64 copy; ValueError when it cannot be X^T X of a
    K-input layer."""
    if hasattr(H, "dtype") and not isinstance(H, np.ndarray):  # mx.array
        import mlx.core as mx
        H = np.array(H.astype(mx.float32))
    H = np.array(H, dtype=np.float64)
    if H.shape != (k_total, k_total):
        raise ValueError(f"H must be K x K = ({k_total}, {k_total}) for w with K={k_total} inputs, got {H.shape}")
    if not np.isfinite(H).all():
        raise ValueError("H has NaN or infinite values")
    d = np.diag(H)
    if (d < 0).any():
        raise ValueError("H has negative diagonal entries; it is not X^T X")
    tol = 1e-5 * max(float(d.max()), 1e-30)
    if np.abs(H - H.T).max() > tol:
        raise ValueError("H is not symmetric; pass X^T X of the layer input")
    return (H + H.T) / 2


def rank_warning(H: np.ndarray, n_tokens, dead: np.ndarray) -> None:
    """RuntimeWarning when X^T X is (close to) rank-deficient: too few
    calibration tokens, channels that were always zero, or tiny pivots."""
    k = H.shape[0]
    why = []
    if n_tokens is not None and n_tokens < k:
        why.append(f"{n_tokens} calibration tokens < K={k}")
    if dead.any():
        why.append(f"{int(dead.sum())} input channels are zero on every calibration token")
    if n_tokens is None and not dead.any():
        # No token count: look at the pivots of H itself (one extra
        # factorization, cheaper than the eigenvalues).
        try:
            L = scipy.linalg.cholesky(H, lower=True, check_finite=False)
            small = (np.diag(L) ** 2).min() < 1e-9 * np.diag(H).mean()
        except np.linalg.LinAlgError:
            small = True
        if small:
            why.append("H has (near-)zero pivots")
    if why:
        warnings.warn(
            f"X^T X of this {k}-input layer is rank-deficient ({'; '.join(why)}): GPTQ then "
            f"leans on damping alone. Calibrate with at least {k} tokens (several times K is better) "
            "from text that exercises every input channel.",
            RuntimeWarning, stacklevel=3)


def inverse_cholesky(H: np.ndarray, damp: float) -> np.ndarray:
    """Upper U with U^T U = (H + lambda I)^-1, lambda = damp * mean(diag H).
    If damping is too small for a factorization, it is raised tenfold (up to
    three times) with a warning rather than failing the sweep."""
    lam = damp * float(np.mean(np.diag(H)))
    idx = np.arange(H.shape[0])
    for attempt in range(4):
        Hd = H.copy()
        Hd[idx, idx] += lam
        try:
            L = scipy.linalg.cholesky(Hd, lower=True, check_finite=False)
            Hinv = scipy.linalg.cho_solve((L, True), np.eye(H.shape[0]), check_finite=False)
            return scipy.linalg.cholesky(Hinv, lower=False, check_finite=False)
        except np.linalg.LinAlgError:
            if attempt == 3:
                raise ValueError("H + damping is not positive definite; check the Hessian") from None
            lam = max(lam * 10, 1e-8 * float(np.abs(H).max()) + 1e-30)
            warnings.warn(f"GPTQ: Cholesky failed, damping raised to {lam:.3g}", RuntimeWarning, stacklevel=3)


def _groups(specs):
    """(first column, size, segment index) of every quantization group."""
    out, k0 = [], 0
    for si, (_, gs, k) in enumerate(specs):
        out += [(k0 + j, gs, si) for j in range(0, k, gs)]
        k0 += k
    return out


def _blocks(groups, block: int):
    """Lazy-update blocks made of whole groups (at most ``block`` columns,
    at least one group), so a group's parameters are always taken from
    columns that already carry every earlier column's error."""
    out, cur = [], []
    for g in groups:
        if cur and sum(x[1] for x in cur) + g[1] > block:
            out.append(cur)
            cur = []
        cur.append(g)
    return out + [cur] if cur else out


def gptq(w, segments, H, perm=None, act_order=True, damp=0.01, block=128, dtype=None, n_tokens=None,
         params="minmax"):
    """GPTQ-quantize ``w`` [N, K] into ``segments`` given ``H = X^T X``
    (K x K, of the layer input, any float dtype; float64 used inside).

    ``act_order=True``: columns ordered by diag(H) descending (stable sort;
    channels never active sort last) and that order is the returned tensor's
    perm. ``act_order=False``: ``perm`` as given, or natural order.
    Passing both ``perm`` and ``act_order=True`` is an error.
    ``damp``: lambda = damp * mean(diag H) added to the diagonal.
    Dead channels (H_kk = 0) get H_kk = 1 and zero weight, as GPTQ does
    (their input was always zero, so only their error-free zero matters).
    ``block``: columns per lazy update (rounded to whole groups).
    ``n_tokens``: calibration tokens behind H, for the rank warning.
    ``params``: how a group's scale/bias are chosen when it is reached:
    "minmax" (MLX's rule on the error-updated columns, as GPTQ does) or
    "search" (``search``'s clip grid + least squares on those columns,
    column j weighted by 1/[H^-1]_jj, the OBQ cost of its rounding error).
    Returns a :class:`mixbits.layout.QuantizedTensor` in the standard layout.
    """
    W, dtype = G.as_weight(w, dtype)
    N, K = W.shape
    specs = G.check_segments(segments, K)
    H = check_hessian(H, K)
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if not (np.isfinite(damp) and damp >= 0):
        raise ValueError(f"damp must be a finite number >= 0, got {damp!r}")
    if params not in ("minmax", "search"):
        raise ValueError(f"params must be 'minmax' or 'search', got {params!r}")
    if perm is not None and act_order:
        raise ValueError("pass perm with act_order=False (act_order=True derives the perm from H)")
    diag = np.diag(H).copy()
    dead = diag == 0
    rank_warning(H, n_tokens, dead)
    if act_order:
        perm = np.argsort(-diag, kind="stable")
    else:
        perm = G.check_perm(perm, K)
    W = W.astype(np.float64)
    if perm is not None:
        W, H, dead = W[:, perm], H[np.ix_(perm, perm)], dead[perm]
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    U = inverse_cholesky(H, float(damp))

    codes = np.zeros((N, K), dtype=np.int64)
    stored = [(np.zeros((N, k // gs), G.F32), np.zeros((N, k // gs), G.F32)) for _, gs, k in specs]
    seg_start = np.cumsum([0] + [k for _, _, k in specs])
    for blk in _blocks(_groups(specs), int(block)):
        b0 = blk[0][0]
        b1 = blk[-1][0] + blk[-1][1]
        W1, U1 = W[:, b0:b1].copy(), U[b0:b1, b0:b1]
        Err = np.zeros_like(W1)
        for g0, gs, si in blk:
            bits = specs[si][0]
            # Affine codes see w rounded to dtype (layout.quantize casts
            # first); ternary ones see w as is (layout.ternary_triplet).
            cast = (lambda v: v.astype(G.F32)) if bits == TERNARY else (lambda v: G.to_dtype(v, dtype))
            grp = cast(W1[:, g0 - b0 : g0 - b0 + gs])
            if params == "search":
                hj = (1.0 / np.diag(U1)[g0 - b0 : g0 - b0 + gs] ** 2)
                hj = (hj / hj.max()).astype(G.F32)[None, None, :]
                t3 = W1[:, g0 - b0 : g0 - b0 + gs].astype(G.F32)[:, None, :]
                if bits == TERNARY:
                    _, s, b = search_ternary(t3, hj, dtype, 20, 2)
                else:
                    _, s, b = search_affine(t3, hj, bits, dtype, 20, 2)
                s, b = s[:, 0], b[:, 0]
            elif bits == TERNARY:
                s = G.ternary_scale(grp)
                b = -G.to_dtype(s, dtype)  # stored as scale s, bias -s
            else:
                s, b = G.minmax_params(grp, bits)
            gi = (g0 - seg_start[si]) // gs
            stored[si][0][:, gi], stored[si][1][:, gi] = s, b
            s_d, b_d = G.to_dtype(s, dtype), G.to_dtype(b, dtype)
            for j in range(g0, g0 + gs):
                c = j - b0
                col = cast(W1[:, c])
                code = G.ternary_codes(col, s) if bits == TERNARY else G.affine_codes(col, s, b, bits)
                codes[:, j] = code
                e = (W1[:, c] - G.decode(code, s_d, b_d)) / U1[c, c]
                W1[:, c + 1 :] -= np.outer(e, U1[c, c + 1 :])
                Err[:, c] = e
        W[:, b1:] -= Err @ U[b0:b1, b1:]

    segs = []
    for si, (bits, gs, k) in enumerate(specs):
        s, b = stored[si]
        segs.append(G.segment(bits, gs, codes[:, seg_start[si] : seg_start[si + 1]],
                              G.to_dtype(s, dtype), G.to_dtype(b, dtype), dtype))
    return G.tensor(segs, perm)
