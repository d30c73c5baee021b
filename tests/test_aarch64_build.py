"""Every C++ source an arm64 build of the extension compiles (CMake's own
selection: no x86 or Metal host files, the NEON ones in) type-checks with
an aarch64 compiler against the installed MLX and nanobind headers, so x86
intrinsics or x86-only code cannot leak into a Mac's CPU build unseen.
Syntax only: linking against the macOS MLX is what tests/metal's link
contract and a Mac check."""

import re
import subprocess
import sysconfig
from pathlib import Path

import mlx.core as mx
import nanobind

from neon_emulator import ARCH_FLAGS, CXX, ROOT, require_tools


def arm64_sources() -> list[Path]:
    """cpp/*/*.cpp filtered by CMakeLists.txt's own exclusion regex, plus
    the NEON sources it adds back on arm64, plus the bindings."""
    cmake = (ROOT / "CMakeLists.txt").read_text()
    exclude = re.search(r'list\(FILTER MIXBITS_OP_SOURCES EXCLUDE REGEX "([^"]+)"\)', cmake).group(1)
    exclude = exclude.replace("\\\\", "\\")
    neon_glob = re.search(r"file\(GLOB MIXBITS_NEON_SOURCES CONFIGURE_DEPENDS([^)]*)\)", cmake).group(1)
    neon = re.findall(r'"\$\{CMAKE_CURRENT_SOURCE_DIR\}/([^"]+)"', neon_glob)
    ops = [p for p in sorted(ROOT.glob("cpp/*/*.cpp")) if not re.match(exclude, str(p))]
    return ops + sorted({p for g in neon for p in ROOT.glob(g)}) + [ROOT / "cpp/bindings.cpp"]


def test_every_arm64_source_type_checks():
    require_tools()
    srcs = arm64_sources()
    names = {p.name for p in srcs}
    assert {"neon.cpp", "neon_t.cpp", "neon_repacked.cpp"} <= names and not any(n.startswith("avx2") or n == "metal.cpp" for n in names)
    incs = [ROOT / "cpp", ROOT / "metal", Path(mx.__file__).parent / "include", nanobind.include_dir(),
            sysconfig.get_paths()["include"]]
    cmd = [CXX, "-std=c++20", "-fsyntax-only", "-Wno-psabi", *ARCH_FLAGS, "-DMIXBITS_HAVE_NEON=1",
           *(f"-I{i}" for i in incs)]
    # Two compilers at once (each source parses all of MLX's headers).
    halves = [subprocess.Popen(cmd + list(map(str, srcs[i::2])), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    for p in halves:
        _, err = p.communicate()
        assert p.returncode == 0, err[-6000:]
