"""Calibrated quantizers (issue 15). Every function returns a
:class:`mixbits.layout.QuantizedTensor` in the standard layout (MLX affine
segments + optional perm), so kernels, layers and saved folders are
unchanged; only how codes, scales and biases are chosen differs.

- :func:`rtn`     round-to-nearest min-max (``layout.quantize``), the baseline;
- :func:`search`  per-group clip/scale search on weighted squared error
                  (diag of X^T X, or ones) -- cheap, no Hessian inverse;
- :func:`gptq`    GPTQ/OBQ error feedback with act-order onto K-segments;
- :func:`awq`     activation-aware per-input-channel scaling; returns the
                  tensor and the scales the caller folds into the previous op.

Numerics are numpy float32/float64 on the CPU and deterministic.
"""

from __future__ import annotations

import mlx.core as mx

from ..layout import QuantizedTensor, quantize
from . import _grid
from .awq import awq
from .gptq import gptq
from .search import search


def rtn(w, segments, perm=None, dtype=None) -> QuantizedTensor:
    """Today's round-to-nearest min-max: ``layout.quantize`` (numpy input
    accepted; dtype defaults to w's float dtype)."""
    wn, dtype = _grid.as_weight(w, dtype)
    return quantize(mx.array(wn), segments, perm=perm, dtype=dtype)


__all__ = ["rtn", "search", "gptq", "awq"]
