"""Public ops. The only module that calls mixbits._ext: every argument is
checked here, with a message naming it, before any kernel runs."""

from __future__ import annotations

import mlx.core as mx

from . import _ext
from ._backends import BACKENDS, backend_id, names
from .layout import BITS, FLOAT_DTYPES, GROUP_SIZES, QuantizedTensor, Segment, check_int

def available_backends() -> list[str]:
    """CPU backends of the quantized matmul usable on this machine."""
    return names(_ext.qmm_backends())


def _backend_id(backend: str | None) -> int:
    return backend_id(backend, available_backends())


def _check_x(x, K: int, name: str = "x") -> None:
    # As MLX: TypeError for a wrong Python type, ValueError for a wrong
    # dtype or shape of an array.
    if not isinstance(x, mx.array):
        raise TypeError(f"{name} must be an mlx.core.array, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != K:
        raise ValueError(f"{name} has last dimension {x.shape[-1:]} but the weight has K={K}")


def qmatmul(x: mx.array, qt: QuantizedTensor, *, backend: str | None = None) -> mx.array:
    """``x @ W.T`` for a mixed-segment quantized W; any leading dims of x.

    With a permutation this is ``x[..., perm] @ qt.dequantize().T``. The
    output has x's dtype; accumulation is float32.
    """
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"qt must be a mixbits.QuantizedTensor, got {type(qt).__name__}")
    _check_x(x, qt.shape[1])
    return _ext.qmatmul(x, qt.perm, qt.arrays(), qt.specs, _backend_id(backend))


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int = 64,
    bits: int = 4,
    *,
    backend: str | None = None,
) -> mx.array:
    """Same meaning as ``mx.quantized_matmul(x, w, scales, biases,
    transpose=True, group_size=group_size, bits=bits)``."""
    check_int("bits", bits, BITS)
    check_int("group_size", group_size, GROUP_SIZES)
    for name, a in (("w", w), ("scales", scales), ("biases", biases)):
        if a is None:
            # MLX: "Biases must be provided for affine quantization" (ValueError).
            raise ValueError(f"{name} must be provided for affine quantization")
        if not isinstance(a, mx.array):
            raise TypeError(f"{name} must be an mlx.core.array, got {type(a).__name__}")
    if w.dtype != mx.uint32 or w.ndim != 2:
        raise ValueError(f"w must be a 2-D uint32 array, got {w.dtype} with shape {w.shape}")
    k = w.shape[1] * 32 // bits
    qt = QuantizedTensor([Segment(bits, group_size, k, w, scales, biases)])
    return qmatmul(x, qt, backend=backend)
