"""Fused SwiGLU on the CPU: ``silu(gate) * up`` in one vectorized pass
(MLX's CPU runs sigmoid and the products as separate scalar passes)."""

from __future__ import annotations

import mlx.core as mx

from . import _ext
from ._backends import backend_id, names, require_cpu

__all__ = ["swiglu", "act_backends"]

def act_backends() -> list[str]:
    return names(_ext.act_backends())


def swiglu(gate: mx.array, up: mx.array, backend: str | None = None) -> mx.array:
    """``silu(gate) * up`` for float32 arrays of one shape."""
    for name, a in (("gate", gate), ("up", up)):
        if not isinstance(a, mx.array):
            raise TypeError(f"{name} must be an mlx.core.array, got {type(a).__name__}")
        if a.dtype != mx.float32:
            raise TypeError(f"{name} must be float32, got {a.dtype}")
    if gate.shape != up.shape:
        raise ValueError(f"gate shape {gate.shape} differs from up shape {up.shape}")
    bid = backend_id(backend)
    require_cpu("swiglu")
    return _ext.swiglu(gate, up, bid)
