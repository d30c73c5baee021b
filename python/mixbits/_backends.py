"""Backend names for the CPU kernels: the one place a ``backend=`` name
becomes the enum value mixbits._ext takes. The enum, its names for error
messages and the availability check with its one message live in
cpp/common/backend.h; tests/test_qmatmul_errors.py checks that this table
equals ``_ext.backend_names()``. (A literal rather than read from the
extension at import, so that an installed extension one build behind
still imports.)"""

from __future__ import annotations

import os
import platform

import mlx.core as mx

from .errors import UsageError

BACKENDS = {"auto": 0, "ref": 1, "avx2": 2, "neon": 3, "avx512": 4}
_NAMES = {v: k for k, v in BACKENDS.items()}


# MIXBITS_ISA: the instruction sets the x86 kernels may use, read once by
# the extension when it first resolves the CPU's (cpp/common/cpu.cpp).
# "avx2" holds them to AVX2 + FMA + F16C, as on a CPU without AVX-512.
ISA_LIMITS = ("native", "avx2")


def isa_limit(environ=os.environ) -> str:
    """MIXBITS_ISA as set ("native" when unset): what the records of a run say."""
    return environ.get("MIXBITS_ISA", "native")


def check_isa_limit(environ=os.environ) -> None:
    """Refuse a MIXBITS_ISA the extension would not understand (it would run
    the CPU's full set without a word), before anything runs."""
    value = isa_limit(environ)
    if value not in ISA_LIMITS:
        raise UsageError(f"MIXBITS_ISA must be one of {', '.join(ISA_LIMITS)} (or unset), got {value!r}")
    if value == "avx2" and platform.machine().lower() not in ("x86_64", "amd64"):
        raise UsageError(f"MIXBITS_ISA=avx2 caps the x86 kernels; this is {platform.machine()}: unset it")


def names(ids) -> list[str]:
    """Backend names for the enum values a ``_ext.*_backends()`` returns."""
    return [_NAMES[b] for b in ids]


def backend_id(backend: str | None) -> int:
    """The enum value for ``backend`` (None = auto), refusing unknown names.
    Whether the op has that backend on this CPU is checked by the op itself
    (ValueError "<op>: backend '<name>' is not available on this CPU ...")."""
    if backend is None:
        return 0
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    return BACKENDS[backend]


def on_cpu() -> bool:
    return mx.default_device().type == mx.cpu


def cpu_for_contract(activations: str | None, repack: bool = False,
                     option: str = "--activations") -> str | None:
    """For the commands: the integer contracts and the repacked layout exist
    as CPU kernels only, so a command asked for either runs on the CPU.
    Where MLX's default device is the GPU (a Mac), this moves it to the CPU
    before any model loads and returns the line to tell the user;
    otherwise None."""
    integer = activations not in (None, "float")
    if not (integer or repack) or on_cpu():
        return None
    was = mx.default_device()
    mx.set_default_device(mx.cpu)
    what = f"{option} {activations}: the integer contracts are" if integer else "--repack: the repacked layout is"
    return (f"{what} CPU kernels, so this runs on the CPU (MLX's default device was {was})")


def require_cpu(op: str) -> None:
    """For ops whose kernels exist on the CPU only."""
    if not on_cpu():
        raise ValueError(f"{op} runs on the CPU only; use mx.set_default_device(mx.cpu) "
                         "or MLX's own op on the GPU")
