"""RMS normalization on the CPU as one graph node.

MLX runs ``mx.fast.rms_norm`` on the CPU as a composed fallback (square,
sum, a fused multiply chain: three nodes); on a decode token, where every
op is tiny, a node's dispatch is most of its cost. :func:`rms_norm` is the
same computation in one node; :mod:`mixbits.routing` sends a patched
model's ``nn.RMSNorm`` calls to it.
"""

from __future__ import annotations

import math

import mlx.core as mx

from . import _ext
from .layout import FLOAT_DTYPES
from ._backends import require_cpu

__all__ = ["rms_norm"]



def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``mx.fast.rms_norm(x, weight, eps)``: x float32/float16/bfloat16,
    ``weight`` of shape ``(x.shape[-1],)``; the result in their promoted
    dtype, equal to MLX's up to float32 rounding of the sum of squares
    (the same roundings to the result dtype otherwise). Gradients are
    MLX's own op's. CPU only."""
    for name, a in (("x", x), ("weight", weight)):
        if not isinstance(a, mx.array):
            raise TypeError(f"{name} must be an mlx.core.array, got {type(a).__name__}")
        if a.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {a.dtype}")
    if x.ndim < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape ({x.shape[-1] if x.ndim else '?'},) for x of shape "
                         f"{x.shape}, got {weight.shape}")
    eps = float(eps)
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    require_cpu("rms_norm")
    return _ext.rms_norm(x, weight, eps)
