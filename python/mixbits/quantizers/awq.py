"""AWQ-style activation-aware scaling.

Input channel k of the weight is multiplied by s_k = mean|x_k|^alpha before
round-to-nearest, and the input by 1/s_k, which leaves X W^T unchanged in
exact arithmetic but spends the grid's resolution on the channels that
carry large activations. alpha is searched on a calibration sample.

Why the caller must fold 1/s into the previous op (no fold-free variant):
our segments hold one scale and bias per (row, group of columns), while
1/s_k varies column by column inside a group, so it cannot be absorbed into
the stored scales or biases; keeping it inside the layer would mean a
per-column multiply of x in every matmul (an inference cost the issue
rules out). A group-constant s would fold, but min-max quantization is
invariant to it, so it would change nothing. Hence ``awq`` returns the
tensor of W diag(s) *and* ``inv_scales`` = 1/s, and the caller multiplies
the previous op's output channels by them:
  - RMSNorm / LayerNorm feeding the layer: ``norm.weight *= inv_scales``
    (LayerNorm: its bias too). Every linear reading that norm (q/k/v, or
    gate/up) must then use the same scales: search once on their rows
    stacked (``np.concatenate([wq, wk, wv])``) and pass the result as
    ``inv_scales=`` to the call for each tensor;
  - down_proj: the rows of up_proj (``w_up *= inv_scales[:, None]``, before
    quantizing up_proj), since act(gate) * up is linear in up;
  - o_proj: the rows of v_proj, only when no KV heads are shared (GQA makes
    one v channel feed several o_proj inputs with different scales).
Where no such op exists (the input is a residual stream, an embedding, a
tied head), do not use AWQ. The search includes alpha = 0 (s = 1, RTN), so
on the calibration sample the result is never worse than RTN.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..layout import quantize
from . import _grid as G


def _dense(qt) -> np.ndarray:
    """Stored weight decoded in float32, original column order."""
    parts = [np.array(mx.dequantize(s.wq, s.scales.astype(mx.float32), s.biases.astype(mx.float32),
                                    group_size=s.group_size, bits=s.bits)) for s in qt.segments]
    d = np.concatenate(parts, axis=1)
    return d if qt.perm is None else d[:, np.argsort(np.array(qt.perm))]


def channel_scales(x_abs_mean: np.ndarray, alpha: float) -> np.ndarray:
    """s = mean|x|^alpha, geometric-centred (max * min = 1) so W diag(s)
    keeps its magnitude; channels never active are floored at 1e-3 of the
    largest mean so their weights are not scaled to nothing."""
    xm = np.maximum(x_abs_mean, 1e-3 * max(float(x_abs_mean.max()), 1e-30))
    s = xm**alpha
    return (s / np.sqrt(s.max() * s.min())).astype(np.float32)


def awq(w, segments, x_abs_mean, X_sample=None, grid=20, dtype=None, perm=None, inv_scales=None):
    """Quantize ``w`` [N, K] with per-input-channel AWQ scales.

    ``x_abs_mean`` (K,): mean |x_k| of the layer input over calibration
    tokens. ``X_sample`` [T, K]: calibration inputs; alpha in
    linspace(0, 1, grid + 1) is chosen to minimise ||X W^T - X What^T||_F
    with What = Q(W diag(s)) diag(1/s) (without a sample: the diagonal
    proxy sum_k mean|x_k|^2 ||w_k - what_k||^2). ``perm``: as in
    ``layout.quantize`` (segment columns count in permuted order).
    ``inv_scales``: skip the search and use these (from an earlier call on
    tensors sharing the input). Returns ``(qt, inv_scales)``: qt stores
    Q(W diag(s)); inv_scales (float32 mx.array (K,), original order) must be
    folded into the previous op, see the module docstring.
    """
    W, dtype = G.as_weight(w, dtype)
    N, K = W.shape
    G.check_segments(segments, K)
    perm = G.check_perm(perm, K)
    xm = G.check_vector("x_abs_mean", x_abs_mean, K)
    if isinstance(grid, bool) or not isinstance(grid, (int, np.integer)) or grid < 0:
        raise ValueError(f"grid must be an int >= 0, got {grid!r}")
    X = None
    if X_sample is not None:
        X = np.asarray(X_sample.astype(mx.float32) if isinstance(X_sample, mx.array) else X_sample, dtype=np.float32)
        if X.ndim != 2 or X.shape[1] != K:
            raise ValueError(f"X_sample must be [T, {K}], got shape {X.shape}")
        if not np.isfinite(X).all():
            raise ValueError("X_sample has NaN or infinite values")

    # Everything goes through inv = 1/s as returned, so a later call with
    # inv_scales= rebuilds the same tensor bit for bit.
    def quant(inv):
        return quantize(mx.array(W / inv[None, :]), segments, perm=perm, dtype=dtype)

    if inv_scales is not None:
        inv = G.check_vector("inv_scales", inv_scales, K).astype(np.float32)
        if (inv <= 0).any():
            raise ValueError("inv_scales must be > 0")
        return quant(inv), mx.array(inv)

    h = xm.astype(np.float64) ** 2

    def loss(inv, qt):
        E = W - _dense(qt) * inv[None, :]
        if X is not None:
            return float(np.square(X @ E.T, dtype=np.float64).sum())
        return float((np.square(E, dtype=np.float64).sum(0) * h).sum())

    best_inv = np.ones(K, np.float32)
    best_qt = quant(best_inv)
    best = loss(best_inv, best_qt)
    for a in np.linspace(0.0, 1.0, grid + 1)[1:]:
        inv = (1.0 / channel_scales(xm, a)).astype(np.float32)
        qt = quant(inv)
        e = loss(inv, qt)
        if e < best:  # strict: ties keep the smaller alpha (RTN first)
            best, best_inv, best_qt = e, inv, qt
    return best_qt, mx.array(best_inv)
