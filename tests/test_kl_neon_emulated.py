"""The NEON KL backend, cross-compiled for aarch64 and run under qemu-user
against the scalar reference (tests/neon/kl_harness.cpp); see
neon_emulator.py for the tools. On an arm64 machine the Python tests run
NEON natively."""

from neon_emulator import build, run


def test_neon_backend_matches_reference(tmp_path):
    exe = build(tmp_path / "kl_neon_harness",
                ["tests/neon/kl_harness.cpp", "cpp/kl/neon.cpp", "cpp/kl/ref.cpp"])
    r = run(exe, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 failures" in r.stdout
