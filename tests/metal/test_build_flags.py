"""The Metal build's promises that only a Mac would otherwise test:

- the kernels refuse to compile under fast math (their compensated sums and
  NaN checks need IEEE arithmetic); checked here with the emulator's g++,
  which defines ``__FAST_MATH__`` as Apple's Metal compiler does;
- the wheel's macOS tag is the macOS the metallib is built for: both come
  from pyproject.toml's ``CMAKE_OSX_DEPLOYMENT_TARGET``, read here through
  scikit-build-core's own settings reader and tag function as a Mac build
  would (even when cibuildwheel sets an older ``MACOSX_DEPLOYMENT_TARGET``).
"""

from __future__ import annotations

import platform
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from metal_emu import EMU_DIR, FLAGS, compiler

ROOT = Path(__file__).resolve().parents[2]


def syntax_check(extra: list[str]) -> subprocess.CompletedProcess:
    cxx = compiler()
    if cxx is None:
        pytest.fail("no C++ compiler (g++ or $CXX): the Metal build checks need one")
    return subprocess.run([cxx, *FLAGS, *extra, "-fsyntax-only", str(EMU_DIR / "emu_kl.cpp")],
                          capture_output=True, text=True)


def test_kernels_compile_without_fast_math():
    r = syntax_check([])
    assert r.returncode == 0, r.stderr[-3000:]


def test_fast_math_build_stops_with_the_reason():
    r = syntax_check(["-ffast-math"])
    assert r.returncode != 0
    assert "must be compiled without fast math" in r.stderr


def darwin_settings():
    from scikit_build_core.settings.skbuild_read_settings import SettingsReader

    with mock.patch.object(sys, "platform", "darwin"):  # what the overrides match on
        return SettingsReader.from_file(ROOT / "pyproject.toml", state="wheel").settings


@pytest.mark.parametrize("env_target", [None, "11.0", "15.0"])
def test_wheel_tag_is_the_metallib_target(env_target):
    from scikit_build_core.builder.macos import get_macosx_deployment_target

    define = darwin_settings().cmake.define
    target = define.get("CMAKE_OSX_DEPLOYMENT_TARGET")
    assert target == "14.0", define
    env = {} if env_target is None else {"MACOSX_DEPLOYMENT_TARGET": env_target}
    with mock.patch.object(platform, "mac_ver", return_value=("15.1", ("", "", ""), "arm64")):
        tag = get_macosx_deployment_target(arm=True, cmake_defines=define, env=env)
    assert str(tag) == target
    cmake = (ROOT / "CMakeLists.txt").read_text()
    # The metallib is built for the same variable, and Metal 3.1 is macOS 14's language.
    call = re.search(r"mlx_build_metallib\((.*?)\)", cmake, re.S).group(1)
    assert re.search(r"DEPLOYMENT_TARGET\s+\$\{CMAKE_OSX_DEPLOYMENT_TARGET\}", call), call
    assert "-std=metal3.1" in call
    assert re.search(r"CMAKE_OSX_DEPLOYMENT_TARGET VERSION_LESS 14\.0\)\s*\n\s*message\(FATAL_ERROR", cmake)


def test_build_requires_a_scikit_build_core_that_tags_from_cmake_define():
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # scikit-build-core depends on tomli before 3.11
        import tomli as tomllib

    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    sbc = [r for r in requires if r.startswith("scikit-build-core")]
    assert sbc == ["scikit-build-core>=1.0"], requires
