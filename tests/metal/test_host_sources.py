"""The Mac-only host sources (cpp/*/metal.cpp, eval_gpu) cannot be built on
Linux, but they can be type-checked: g++ -fsyntax-only with _METAL_ defined,
against the real MLX Metal-backend headers installed with mlx, with
tests/metal/stub/Metal/Metal.hpp standing in for Apple's metal-cpp. This
catches wrong MLX API names and signatures, wrong includes, and drift from
the params/host headers; it cannot check the Metal API calls themselves."""

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core  # noqa: F401  (the package whose headers are checked against)
import pytest

import metal_emu as E

HOST_SOURCES = sorted((E.ROOT / "cpp").glob("*/metal.cpp"))


def mlx_include() -> Path:
    import mlx
    for p in mlx.__path__:
        inc = Path(p) / "include"
        if (inc / "mlx" / "backend" / "metal" / "device.h").exists():
            return inc
    pytest.skip("this mlx install has no Metal backend headers")


def test_every_op_with_a_kernel_has_a_host_source():
    assert {p.parent.name for p in HOST_SOURCES} >= {"qmatmul", "kl"}


def test_eval_gpu_sources_typecheck_against_mlx_headers():
    cxx = E.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    inc = mlx_include()

    def check(src: Path):
        cmd = [cxx, "-std=c++20", "-fsyntax-only", "-D_METAL_", "-Wall", "-Werror",
               f"-I{E.EMU_DIR / 'stub'}", f"-I{inc}", f"-I{E.ROOT / 'cpp'}",
               f"-I{E.METAL_DIR}", str(src)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        return src, r.returncode, r.stderr

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(check, HOST_SOURCES))
    failed = [f"{src}:\n{err[-4000:]}" for src, rc, err in results if rc != 0]
    assert not failed, "\n".join(failed)
