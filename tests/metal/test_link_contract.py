"""The link-level contract with libmlx, checked on Linux.

On macOS libmlx exports only what its headers declare with MLX_API; the
extension links only if every MLX symbol it references is one of those.
-fsyntax-only (test_host_sources.py) cannot see this, so here every source
of the extension is compiled to an object (cpp/*/metal.cpp with _METAL_
and the metal-cpp stand-in, as on a Mac) and its undefined MLX symbols are
checked against the headers' MLX_API declarations (link_contract.py says
how). Objects are cached under build/link-contract/ by a hash of the
sources, flags, compiler and MLX headers.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import link_contract as L
import metal_emu as E

CPP = E.ROOT / "cpp"
CACHE = E.ROOT / "build" / "link-contract"
METAL_HOST = sorted(CPP.glob("*/metal.cpp"))
# neon*.cpp (CMakeLists.txt's NEON sources: neon.cpp, neon_t.cpp...) are
# arm64-only code with no MLX include (checked below).
OTHER = sorted(p for p in CPP.rglob("*.cpp")
               if p.name != "metal.cpp" and not p.name.startswith("neon"))
X86 = platform.machine() in ("x86_64", "AMD64")


def mlx_include() -> Path:
    import mlx
    return Path(mlx.__path__[0]) / "include"


def tools_or_fail():
    missing = [t for t in (E.compiler(), shutil.which("nm"), shutil.which("readelf"),
                           shutil.which("c++filt")) if t is None]
    assert not missing, "this check needs g++, nm, readelf and c++filt (binutils)"
    return E.compiler()


def includes() -> list[Path]:
    import nanobind
    inc = [E.EMU_DIR / "stub", mlx_include(), CPP, E.METAL_DIR]
    inc.append(Path(nanobind.include_dir()))
    inc.append(Path(sysconfig.get_paths()["include"]))
    return inc


def flags_for(src: Path) -> tuple[list[str], list[str]]:
    """(defines, extra flags) as CMakeLists.txt compiles the file."""
    if src.name == "metal.cpp":
        return ["_METAL_", "MIXBITS_HAS_METALLIB=1"], []
    if src.name == "avx2.cpp" or src.name.startswith("avx2_"):
        return ["MIXBITS_HAVE_AVX2=1"], ["-mavx2", "-mfma", "-mf16c"]
    return (["MIXBITS_HAVE_AVX2=1"] if X86 else []), []


def cache_key(cxx: str, sources: list[Path]) -> str:
    h = hashlib.sha256()
    h.update(subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.encode())
    h.update(Path(L.__file__).read_bytes())
    files = sorted(CPP.rglob("*")) + sorted(E.METAL_DIR.glob("*")) + \
        sorted((E.EMU_DIR / "stub").rglob("*")) + [L.PRELUDE]
    for f in files:
        if f.is_file():
            h.update(str(f.relative_to(E.ROOT)).encode())
            h.update(f.read_bytes())
    h.update(str(sources).encode())
    import mlx.core as mx
    h.update(mx.__version__.encode())
    return h.hexdigest()[:16]


def analyse(sources: list[Path]) -> dict[str, dict]:
    """{source: {"undefined": [...], "hidden": [...]}} for every source."""
    cxx = tools_or_fail()
    key = cache_key(cxx, sources)
    cached = CACHE / f"{key}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    inc = includes()

    def one(src: Path):
        defines, extra = flags_for(src)
        with tempfile.TemporaryDirectory() as d:
            obj = Path(d) / "o.o"
            L.compile_object(cxx, src, obj, inc, defines, extra)
            return str(src.relative_to(E.ROOT)), {
                "undefined": L.undefined_mlx_symbols(obj),
                "hidden": L.hidden_mlx_references(obj)}

    with ThreadPoolExecutor(2) as pool:
        result = dict(pool.map(one, sources))
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, cached)
    return result


def report(bad: dict[str, list[str]]) -> str:
    return "\n".join(f"{src} references MLX symbols libmlx does not export (not MLX_API):\n  "
                     + "\n  ".join(syms) for src, syms in bad.items())


def test_metal_host_sources_use_only_exported_mlx_symbols():
    assert {p.parent.name for p in METAL_HOST} >= {"qmatmul", "kl", "gather", "fpmatmul"}
    res = analyse(METAL_HOST)
    for src, r in res.items():
        # The _METAL_ branch was really compiled: eval_gpu talks to MLX's
        # Metal backend.
        assert any(s.startswith("mlx::core::metal::") for s in r["undefined"]), src
    bad = {src: r["hidden"] for src, r in res.items() if r["hidden"]}
    assert not bad, report(bad)


def test_every_other_extension_source_uses_only_exported_mlx_symbols():
    if not X86:
        pytest.skip("the AVX2 sources compile only for x86-64")
    res = analyse(OTHER)
    assert sum(bool(r["undefined"]) for r in res.values()) >= 4  # the op builders
    bad = {src: r["hidden"] for src, r in res.items() if r["hidden"]}
    assert not bad, report(bad)


def test_neon_sources_need_no_mlx():
    for src in CPP.glob("*/neon*.cpp"):
        assert '#include "mlx/' not in src.read_text(), src


def test_cpu_symbols_referenced_exist_in_linux_libmlx():
    # A second, independent source: the Linux library defines every
    # non-Metal MLX symbol the extension references (its Metal backend is
    # absent here, so those are checked against the headers only).
    import mlx
    lib = Path(mlx.__path__[0]) / "lib" / "libmlx.so"
    if not lib.exists():
        pytest.skip("no libmlx.so (not Linux)")
    exported = L.exported_by(lib)
    res = analyse(METAL_HOST)
    if X86:
        res.update(analyse(OTHER))
    missing = {src: [s for s in r["undefined"]
                     if not s.startswith("mlx::core::metal::") and s not in exported]
               for src, r in res.items()}
    missing = {k: v for k, v in missing.items() if v}
    assert not missing, missing


CANARY = r"""
#include "mlx/backend/gpu/copy.h"
#include "mlx/backend/metal/device.h"
namespace mx = mlx::core;
mx::array uses_internal(const mx::array& a, const mx::Stream& s) {
  return mx::contiguous_copy_gpu(a, s);
}
void uses_public(const mx::Stream& s) { mx::metal::get_command_encoder(s); }
"""


def test_checker_flags_a_symbol_without_mlx_api(tmp_path):
    # What the check would have said about the old eval_gpu (it called
    # contiguous_copy_gpu, declared without MLX_API in backend/gpu/copy.h).
    cxx = tools_or_fail()
    src = tmp_path / "canary.cpp"
    src.write_text(CANARY)
    obj = tmp_path / "canary.o"
    L.compile_object(cxx, src, obj, includes(), ["_METAL_"])
    hidden = L.hidden_mlx_references(obj)
    assert any(s.startswith("mlx::core::contiguous_copy_gpu(") for s in hidden), hidden
    assert not any("get_command_encoder" in s for s in hidden), hidden
    assert any("get_command_encoder" in s for s in L.undefined_mlx_symbols(obj))
