"""Causal grouped-query attention on the CPU (the mixbits kernel); see
:mod:`mixbits.routing` for routing mlx-lm models' prefill attention to it.

MLX's CPU ``scaled_dot_product_attention`` materializes every head's full
T x T score matrix; on SmolLM2 it was most of a decoder layer's time at
256+ tokens. ``causal_attention`` computes the same result per (batch, KV
head, block of 32 query positions) with two small register-tiled GEMMs
around an in-cache softmax, skipping the keys a block never sees.
"""

from __future__ import annotations

import math

import mlx.core as mx

from . import _ext
from ._backends import backend_id, names, require_cpu
from .layout import FLOAT_DTYPES

__all__ = ["causal_attention", "attn_backends", "fits_kernel"]


def fits_kernel(q: mx.array, k: mx.array, v: mx.array) -> bool:
    """Whether q, k and v have the shapes :func:`causal_attention` takes:
    4-D, k and v one shape, q's batch and head size those of k, whole
    query groups per KV head, at least as many keys as queries. Multi-head
    latent attention (DeepSeek-V2, MiniCPM3: key heads 192 wide, value
    heads 128) does not: the router sends such calls to MLX's op."""
    if not (q.ndim == k.ndim == v.ndim == 4) or k.shape != v.shape:
        return False
    return (q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3] and k.shape[1] >= 1
            and q.shape[1] % k.shape[1] == 0 and k.shape[2] >= q.shape[2])


def attn_backends() -> list[str]:
    """CPU backends of the attention kernel usable on this machine."""
    return names(_ext.attn_backends())


def causal_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                     backend: str | None = None, kv_len: mx.array | None = None) -> mx.array:
    """softmax(scale * q k^T + causal mask) v.

    q is [B, H, T, D]; k and v are [B, Hk, S, D] with H a multiple of Hk and
    S >= T; query t sees keys 0 .. t + S - T (the queries are the last T
    positions, as with a KV cache); returns [B, H, T, D] in their dtype
    (float32, float16 or bfloat16, all three the same; half-precision
    inputs are computed in float32 and the result rounded once). Equal to
    ``mx.fast.scaled_dot_product_attention(q, k, v, scale=scale,
    mask="causal")`` up to float32 rounding (and that output rounding).

    ``kv_len`` (an integer array of one element, read when the graph runs:
    a compiled decode step passes its cache offset + 1) cuts k and v to
    their first ``kv_len`` rows: the same result as with
    ``k[:, :, :kv_len]``, without the copy. A value outside [T, S] gives
    NaN (it is not known when the graph is built).
    """
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not isinstance(a, mx.array):
            raise TypeError(f"{name} must be an mlx.core.array, got {type(a).__name__}")
        if a.ndim != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, length, head_dim], got shape {a.shape}")
        if a.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {a.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k shape {k.shape} differs from v shape {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {q.shape} and k {k.shape} differ in batch or head_dim")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of the k/v heads ({k.shape[1]})")
    if k.shape[2] < q.shape[2]:
        raise ValueError(f"k/v length ({k.shape[2]}) must be at least the query length ({q.shape[2]})")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if kv_len is not None and (not isinstance(kv_len, mx.array) or kv_len.size != 1
                               or not mx.issubdtype(kv_len.dtype, mx.integer)):
        raise ValueError(f"kv_len must be an integer mlx array of one element, got {kv_len!r}")
    bid = backend_id(backend)
    require_cpu("causal_attention")
    return _ext.causal_attention(q, k, v, scale, bid, kv_len)
