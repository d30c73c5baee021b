"""Which MLX symbols an object file needs that libmlx does not export.

libmlx is built with hidden visibility: on macOS only what its headers
declare with ``MLX_API`` (directly, or as a member of an ``MLX_API``
class) is exported, and an extension that calls anything else fails to
link there. Linux's libmlx.so (the CPU build) is no guide: it lacks the
Metal backend altogether.

The headers are the contract, and the compiler reads them for us: every
source is compiled with ``#pragma GCC visibility push(hidden)`` in force
(hidden_by_default.h, included first). Unlike ``-fvisibility=hidden`` the
pragma also applies to *declarations*, so a reference to a function the
headers declare without ``MLX_API`` becomes an undefined symbol with
visibility HIDDEN in the object, while ``MLX_API`` (visibility("default"))
overrides the pragma. ``readelf`` shows the visibility of each undefined
symbol; ``nm -C --undefined-only`` lists them all.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
PRELUDE = HERE / "hidden_by_default.h"


def compile_object(cxx: str, src: Path, obj: Path, includes: list[Path], defines=(),
                   extra=()) -> None:
    cmd = [cxx, "-std=c++20", "-c", "-O0", "-fPIC", "-w", "-include", str(PRELUDE),
           *(f"-D{d}" for d in defines), *extra, *(f"-I{p}" for p in includes), str(src),
           "-o", str(obj)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"compiling {src} failed:\n{r.stderr[-6000:]}")


def _demangle(names: list[str]) -> list[str]:
    if not names:
        return []
    r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                       check=True)
    return r.stdout.splitlines()


def is_mlx_symbol(demangled: str) -> bool:
    # Functions and data in mlx::, and the RTTI / vtables of its classes.
    for prefix in ("mlx::", "typeinfo for mlx::", "typeinfo name for mlx::",
                   "vtable for mlx::", "VTT for mlx::"):
        if demangled.startswith(prefix):
            return True
    return False


def undefined_mlx_symbols(obj: Path) -> list[str]:
    """Every MLX symbol the object needs from elsewhere (nm -C --undefined-only)."""
    r = subprocess.run(["nm", "-C", "--undefined-only", str(obj)], capture_output=True,
                       text=True, check=True)
    names = [line.split(None, 1)[1] for line in r.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if is_mlx_symbol(n))


def hidden_mlx_references(obj: Path) -> list[str]:
    """The undefined MLX symbols whose declaration is not MLX_API."""
    r = subprocess.run(["readelf", "-sW", str(obj)], capture_output=True, text=True,
                       check=True)
    hidden = []
    for line in r.stdout.splitlines():
        f = line.split()
        # Num: Value Size Type Bind Vis Ndx Name
        if len(f) >= 8 and f[6] == "UND" and f[5] == "HIDDEN":
            hidden.append(f[7])
    return sorted(n for n in _demangle(hidden) if is_mlx_symbol(n))


def exported_by(lib: Path) -> set[str]:
    """Demangled names of the functions and data a shared library defines."""
    r = subprocess.run(["nm", "-DC", "--defined-only", str(lib)], capture_output=True,
                       text=True, check=True)
    out = set()
    for line in r.stdout.splitlines():
        f = line.split(None, 2)
        if len(f) == 3:
            out.add(f[2])
    return out
