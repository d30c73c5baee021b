"""Fused SwiGLU on the CPU: ``silu(gate) * up`` in one vectorized pass
(MLX's CPU runs sigmoid and the products as separate scalar passes)."""

from __future__ import annotations

import mlx.core as mx

from . import _ext

__all__ = ["swiglu", "act_backends"]

BACKENDS = {"auto": 0, "ref": 1, "avx2": 2}


def act_backends() -> list[str]:
    names = {v: k for k, v in BACKENDS.items()}
    return [names[b] for b in _ext.act_backends()]


def swiglu(gate: mx.array, up: mx.array, backend: str | None = None) -> mx.array:
    """``silu(gate) * up`` for float32 arrays of one shape."""
    for name, a in (("gate", gate), ("up", up)):
        if not isinstance(a, mx.array):
            raise TypeError(f"{name} must be an mlx.core.array, got {type(a).__name__}")
        if a.dtype != mx.float32:
            raise TypeError(f"{name} must be float32, got {a.dtype}")
    if gate.shape != up.shape:
        raise ValueError(f"gate shape {gate.shape} differs from up shape {up.shape}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    if backend not in (None, "auto") and backend not in act_backends():
        raise ValueError(f"backend {backend!r} is not available on this CPU")
    if mx.default_device().type != mx.cpu:
        raise ValueError("swiglu runs on the CPU only; use mx.set_default_device(mx.cpu) "
                         "or MLX's own op on the GPU")
    return _ext.swiglu(gate, up, BACKENDS[backend or "auto"])
