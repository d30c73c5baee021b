"""common/convert.h's NEON conversions (a Mac's CPU path for float16
models' attention, norms, rope and matmul activations), cross-compiled for
aarch64 and run under qemu-user against the scalar ones
(tests/neon/convert_harness.cpp); see neon_emulator.py for the tools."""

from neon_emulator import build, run


def test_neon_conversions_match_scalar(tmp_path):
    exe = build(tmp_path / "convert_harness",
                ["tests/neon/convert_harness.cpp", "cpp/common/convert.cpp", "cpp/common/neon_convert.cpp"])
    r = run(exe, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "convert: 0 failures" in r.stdout
