"""The NEON KL backend, cross-compiled for aarch64 and run under qemu-user
against the scalar reference (tests/kl_neon/harness.cpp). Skipped where
the cross compiler or qemu is missing (apt: g++-aarch64-linux-gnu,
qemu-user); on an arm64 machine the Python tests run NEON natively."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which("aarch64-linux-gnu-g++")
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")


@pytest.mark.skipif(not (CXX and QEMU), reason="aarch64 cross compiler or qemu-user not installed")
def test_neon_backend_matches_reference(tmp_path):
    exe = tmp_path / "kl_neon_harness"
    subprocess.run(
        [CXX, "-std=c++20", "-O2", "-static", "-DMIXBITS_HAVE_NEON=1", f"-I{ROOT / 'cpp'}",
         str(ROOT / "tests/kl_neon/harness.cpp"), str(ROOT / "cpp/kl/neon.cpp"),
         str(ROOT / "cpp/kl/ref.cpp"), "-o", str(exe)],
        check=True, capture_output=True, text=True,
    )
    r = subprocess.run([QEMU, str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 failures" in r.stdout
