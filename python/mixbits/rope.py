"""Rotary position embedding on the CPU as one graph node.

MLX runs ``mx.fast.rope`` on the CPU as a composed fallback of ~13 nodes a
call that recomputes its cosines and sines every time; on a decode token
(60 calls in SmolLM2) those nodes' dispatch is most of the cost.
:func:`rope` is the same rotation in one node; :mod:`mixbits.routing`
sends a patched model's ``nn.RoPE`` calls to it, and a compiled decode
step (:mod:`mixbits.decode`) passes its position as an array.
"""

from __future__ import annotations

import math

import mlx.core as mx

from . import _ext
from .layout import FLOAT_DTYPES
from ._backends import require_cpu

__all__ = ["rope"]



def rope(x: mx.array, dims: int, *, traditional: bool = False, base: float = 10000.0,
         scale: float = 1.0, offset: int | mx.array = 0) -> mx.array:
    """``mx.fast.rope(x, dims, traditional=, base=, scale=, offset=)`` for x
    ``(..., L, D)`` float32/float16/bfloat16; ``offset`` an int or an
    integer array of one element (read when the graph runs). Angles,
    cosines and the rotation in float32, one rounding to x's dtype: as
    accurate as MLX's op (both limited by float32 angles, ~pos·1e-7 rad).
    Gradients wrt x are MLX's own op's. CPU only."""
    if not isinstance(x, mx.array):
        raise TypeError(f"x must be an mlx.core.array, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dims (..., L, D), got shape {x.shape}")
    if not isinstance(dims, int) or dims < 2 or dims % 2 or dims > x.shape[-1]:
        raise ValueError(f"dims must be an even int in [2, {x.shape[-1]}], got {dims!r}")
    if isinstance(offset, bool) or not isinstance(offset, (int, mx.array)):
        raise TypeError(f"offset must be an int or an mlx array, got {type(offset).__name__}")
    if isinstance(offset, int):
        offset = mx.array(offset, dtype=mx.int32)
    elif offset.size != 1 or not mx.issubdtype(offset.dtype, mx.integer):
        raise ValueError(f"offset must be one integer, got shape {offset.shape} of {offset.dtype}")
    base, scale = float(base), float(scale)
    if not (math.isfinite(base) and base > 0) or not math.isfinite(scale):
        raise ValueError(f"base must be finite and > 0 and scale finite, got {base}, {scale}")
    require_cpu("rope")
    return _ext.rope(x, offset, dims, bool(traditional), base, scale)
