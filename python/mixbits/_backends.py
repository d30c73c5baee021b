"""Backend names for the CPU kernels and the checks every op runs on a
``backend=`` argument before calling mixbits._ext. Every cpp/*/kernel.h
backend enum uses this numbering."""

from __future__ import annotations

import mlx.core as mx

BACKENDS = {"auto": 0, "ref": 1, "avx2": 2, "neon": 3}
_NAMES = {v: k for k, v in BACKENDS.items()}


def names(ids) -> list[str]:
    """Backend names for the enum values a ``_ext.*_backends()`` returns."""
    return [_NAMES[b] for b in ids]


def backend_id(backend: str | None, available: list[str]) -> int:
    """The enum value for ``backend`` (None = auto), refusing unknown names
    and backends this CPU cannot run (``available``: their names)."""
    if backend is None:
        return 0
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    if backend != "auto" and backend not in available:
        raise ValueError(f"backend {backend!r} is not available on this CPU")
    return BACKENDS[backend]


def on_cpu() -> bool:
    return mx.default_device().type == mx.cpu


def require_cpu(op: str) -> None:
    """For ops whose kernels exist on the CPU only."""
    if not on_cpu():
        raise ValueError(f"{op} runs on the CPU only; use mx.set_default_device(mx.cpu) "
                         "or MLX's own op on the GPU")
