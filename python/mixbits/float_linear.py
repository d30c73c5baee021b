"""Float layers at full speed on the CPU: ``x @ W.T (+ b)`` for float32,
float16 and bfloat16 weights, as one MLX node (``_ext.float_matmul``).

Why: on Linux the ``mlx-cpu`` wheel's matmul is a reference BLAS (under
2.2 GFLOP/s on this project's hosts), so a float model's forward -- the
reference pass of ``mixbits measure`` / ``convert`` on a bf16/fp16 Hugging
Face checkpoint -- was unusably slow. On macOS MLX already calls
Accelerate; nothing is routed there.

Which code computes what, and why:

- many rows of x (a prompt, a calibration chunk): OpenBLAS's ``sgemm``,
  the very library numpy already loaded (``numpy.libs``), found by its
  file and opened from C++ at first use (``dlopen`` / ``dlsym``; nothing is
  linked at build time). It is a well-kept, CPU-tuned GEMM: its speed is
  the benchmark's baseline, and writing our own would only chase it.
  Half-precision operands are widened to float32 (``cpp/common/convert.h``'s
  bulk conversions) in blocks of output columns, about 4 MiB of weight
  each, just before each block's ``sgemm``: at M rows a widened weight
  element then serves 2M flops;
- a few rows (a decode step, a short chunk: M <= 16 for a float32 weight,
  M <= 32 for a half one; ``_ext.float_matmul_gemv_max_rows``): a GEMV of
  our own (``cpp/linear/avx2.cpp``) that reads the weight in its own dtype
  and widens it in registers, streaming 2 bytes per half weight where a
  widened copy would cost BLAS 10. At M = 1 the product is bound by memory
  bandwidth; up to those M OpenBLAS's ``sgemm`` was measured slower than
  this GEMV even on float32 (it is tuned for large M). Without AVX2
  (arm64 Linux) these go to BLAS too;
- no BLAS found: the GEMV at every M (correct, slower), or, in the router,
  MLX's own op.

Sums are float32 whatever the dtypes; the result has the inputs' promoted
dtype, rounded once (bias added before the rounding). Results do not
depend on the thread count: the GEMV splits only output columns across
threads, and the BLAS path splits the output into column blocks whose
width depends on K and N only, each one single-threaded ``sgemm`` call
(OpenBLAS's own threading sums K in blocks that move with its thread
count: the last bits changed between 1 and 2 threads). mixbits' pool
(``_ext.set_max_threads``) shares the blocks; OpenBLAS's own thread count
(numpy's) is held at 1 during those calls and restored after.

Gradients: the node's vjp is three ``float_matmul`` products (dx = g @ W,
dW = g.T @ x, db = sum g); its jvp is MLX's ops'.

``MIXBITS_BLAS`` names another CBLAS library file to use, or ``none`` to
use no BLAS (the router then leaves float layers to MLX).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import mlx.core as mx

from . import _ext
from ._backends import backend_id, names, on_cpu, require_cpu
from .layout import FLOAT_DTYPES

__all__ = ["float_matmul", "linear", "blas_library", "available_backends", "PATHS", "routes"]

PATHS = {"auto": 0, "gemv": 1, "blas": 2}


def _loaded_openblas() -> list[str]:
    """Files of an OpenBLAS this process has mapped (numpy's, once numpy is
    imported): the library numpy itself calls, whatever its wheel names it."""
    try:
        with open("/proc/self/maps") as f:
            paths = [line.split(None, 5)[-1].strip() for line in f if "openblas" in line.lower()]
    except OSError:
        return []
    return sorted({p for p in paths if p.startswith("/") and ".so" in p})


def _candidates() -> list[str]:
    import numpy as np  # loads numpy's OpenBLAS

    found = _loaded_openblas()
    # numpy >= 2 wheels: numpy.libs/libscipy_openblas64_-*.so; older: numpy/.libs.
    root = Path(np.__file__).resolve().parent
    for d in (root.parent / "numpy.libs", root / ".libs"):
        found += sorted(str(p) for p in d.glob("*openblas*.so*")) if d.is_dir() else []
    return list(dict.fromkeys(found))


@functools.cache
def blas_library() -> str | None:
    """The CBLAS file float_matmul uses (loaded on the first call), or None:
    not on Linux, ``MIXBITS_BLAS=none``, no loadable OpenBLAS found, or an
    extension without float_matmul."""
    load = getattr(_ext, "load_blas", None)
    # No load_blas: an extension built before float_matmul (an editable
    # install not rebuilt yet); the float layers then stay MLX's.
    if not sys.platform.startswith("linux") or load is None:
        return None
    choice = os.environ.get("MIXBITS_BLAS", "")
    if choice.lower() == "none":
        return None
    for path in [choice] if choice else _candidates():
        if load(path) == "":
            return path
    return None


def available_backends() -> list[str]:
    """The GEMV's CPU backends usable here (for tests and benchmarks)."""
    return names(_ext.float_matmul_backends())


def float_matmul(a: mx.array, b: mx.array, bias: mx.array | None = None, *, trans_a: bool = False,
                 trans_b: bool = True, backend: str | None = None, path: str = "auto") -> mx.array:
    """``A @ op(B) + bias`` (``A.T @ op(B) + bias`` with ``trans_a``), A being
    a's rows (``a.reshape(-1, a.shape[-1])``), ``op(B) = B.T`` with
    ``trans_b`` (the default: ``x @ W.T``, nn.Linear's product). Without
    ``trans_a`` the result has shape ``a.shape[:-1] + (N,)``; with it (a
    2-D), ``(a.shape[1], N)``. float32 sums, the promoted dtype out. CPU.
    ``path``: ``"auto"``, or ``"gemv"`` / ``"blas"`` at every M (tests,
    benchmarks); ``backend`` picks the GEMV kernel."""
    for name, v in (("a", a), ("b", b), ("bias", bias)):
        if v is None and name == "bias":
            continue
        if not isinstance(v, mx.array):
            raise TypeError(f"{name} must be an mlx.core.array, got {type(v).__name__}")
        if v.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {v.dtype}")
    if path not in PATHS:
        raise ValueError(f"path must be one of {sorted(PATHS)}, got {path!r}")
    require_cpu("float_matmul")
    blas_library()  # load it before the first node that may need it
    try:
        return _ext.float_matmul(a, b, bias, bool(trans_a), bool(trans_b), backend_id(backend), PATHS[path])
    except ValueError as e:  # the builder's invalid_argument: shapes, backend
        raise ValueError(str(e)) from None


def linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """``nn.Linear``'s ``x @ weight.T + bias`` as one float_matmul node, for
    a routed model's calls: the arguments are those :func:`routes` accepted
    (which is what float_matmul's checks would verify again on every call of
    every layer), and the BLAS is loaded (``routes`` asked for it)."""
    return _ext.float_matmul(x, weight, bias, False, True, 0, PATHS["auto"])


def routes(x, weight, bias=None) -> bool:
    """Whether a routed model's ``nn.Linear`` call (or a tied head's
    ``as_linear``) on these arrays goes to :func:`float_matmul`: on the CPU
    with a BLAS (Linux), float arrays, a 2-D weight whose K is x's last axis."""
    return (on_cpu() and isinstance(x, mx.array) and x.dtype in FLOAT_DTYPES and x.ndim >= 1
            and weight.dtype in FLOAT_DTYPES and weight.ndim == 2 and x.shape[-1] == weight.shape[1]
            and (bias is None or (bias.dtype in FLOAT_DTYPES and bias.shape == (weight.shape[0],)))
            and blas_library() is not None)
