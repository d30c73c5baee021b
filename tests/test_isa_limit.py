"""MIXBITS_ISA=avx2: the extension holds its x86 kernels to AVX2 + FMA +
F16C, as on a CPU without AVX-512, so every "auto" choice takes the AVX2
rows (cpp/common/cpu.cpp reads it once, with the CPUID checks). Any other
value but "native" is refused when mixbits is imported. Each case runs in
a child process: the choice is made once per process.

On a CPU with AVX-512 the kernel suites also run under the cap here, so the
AVX2 rows are exercised through every op's own dispatch (not only where a
test forces backend="avx2"). Planted bug: the cap not read (cpu.cpp) fails
test_avx2_cap_hides_avx512 and test_auto_is_avx2_under_the_cap.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mixbits import ops

HERE = Path(__file__).resolve().parent
X86_AVX2 = "avx2" in ops.available_backends()
AVX512 = "avx512" in ops.available_backends()  # False in a run under the cap


def run_child(code: str, isa: str | None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("MIXBITS_ISA", None)
    if isa is not None:
        env["MIXBITS_ISA"] = isa
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout)


BACKENDS = "from mixbits import ops; print(','.join(ops.available_backends()))"


@pytest.mark.skipif(not X86_AVX2, reason="needs an x86 CPU with AVX2 (the cap's only effect)")
def test_avx2_cap_hides_avx512():
    capped = run_child(BACKENDS, "avx2")
    assert capped.returncode == 0, capped.stderr
    assert capped.stdout.split() == ["ref,avx2"]
    native = run_child(BACKENDS, "native")
    assert native.returncode == 0, native.stderr
    cpu = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else set()
    assert native.stdout.split() == ["ref,avx2,avx512" if "avx512f" in cpu else "ref,avx2"]


# Products on every path that picks its kernels itself: the float contract,
# int8 on MLX's layout, and int8 on the repacked layout (one and three x
# rows), two segments and a permutation; each auto result must equal the
# forced AVX2 one bit for bit.
AUTO_VS_AVX2 = """
import mlx.core as mx, numpy as np, mixbits
from mixbits import ops
rng = np.random.default_rng(0)
w = mx.array(rng.standard_normal((40, 256)).astype(np.float32))
qt = mixbits.quantize(w, [(4, 64, 128), (3, 32, 128)], perm=mx.array(rng.permutation(256).astype(np.int32)))
rt = ops.repack(qt)
for m in (1, 3):
    x = mx.array(rng.standard_normal((m, 256)).astype(np.float32))
    for t, acts in ((qt, ("float", "int8")), (rt, ("int8",))):
        for act in acts:
            a = np.array(mixbits.qmatmul(x, t, activations=act))
            b = np.array(mixbits.qmatmul(x, t, activations=act, backend="avx2"))
            print(m, type(t).__name__, act, bool((a.view(np.uint32) == b.view(np.uint32)).all()))
"""


@pytest.mark.skipif(not X86_AVX2, reason="needs an x86 CPU with AVX2 (the cap's only effect)")
def test_auto_is_avx2_under_the_cap():
    r = run_child(AUTO_VS_AVX2, "avx2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 6 and all(line.endswith("True") for line in lines), r.stdout
    if AVX512:
        # Without the cap the float contract takes the AVX-512 rows, whose
        # sums round differently: the comparison above can tell them apart.
        r = run_child(AUTO_VS_AVX2, None)
        assert r.returncode == 0, r.stderr
        assert any(line.endswith("False") for line in r.stdout.splitlines()), r.stdout


@pytest.mark.parametrize("value", ["avx512", "AVX2", "", "scalar"])
def test_other_values_are_refused_at_import(value):
    r = run_child("import mixbits", value)
    assert r.returncode != 0
    assert "MIXBITS_ISA must be one of native, avx2" in r.stderr and repr(value) in r.stderr


def test_avx2_cap_refused_off_x86(monkeypatch):
    from mixbits import _backends
    from mixbits.errors import UsageError

    monkeypatch.setattr(_backends.platform, "machine", lambda: "arm64")
    with pytest.raises(UsageError, match="caps the x86 kernels; this is arm64"):
        _backends.check_isa_limit({"MIXBITS_ISA": "avx2"})
    _backends.check_isa_limit({"MIXBITS_ISA": "native"})  # accepted everywhere


@pytest.mark.skipif(not X86_AVX2, reason="needs an x86 CPU with AVX2 (the cap's only effect)")
def test_bench_says_when_it_ran_under_the_cap(tmp_path):
    out = tmp_path / "b.json"
    code = ("from mixbits.cli import main; raise SystemExit(main(['bench', '--shapes', '64x128', '--m', '1', "
            f"'--kinds', '4bit', '--no-baselines', '--min-time', '0.01', '--json', {str(out)!r}]))")
    r = run_child(code, "avx2")
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["machine"]["isa_limit"] == "avx2" and res["machine"]["backends"] == ["ref", "avx2"]
    assert any(n.startswith("MIXBITS_ISA=avx2") for n in res["notes"])


# The suites whose ops choose their own kernels on the CPU.
KERNEL_SUITES = ["test_qmatmul.py", "test_qmatmul_int8.py", "test_qmatmul_transposed.py",
                 "test_repack.py", "test_repack_56.py", "test_repack_stacks.py", "test_gather.py",
                 "test_gather_int8.py", "test_attention.py", "test_kl.py", "test_norm.py", "test_rope.py"]


@pytest.mark.skipif(not AVX512, reason="without AVX-512 the whole suite already runs the AVX2 rows")
def test_kernel_suites_pass_under_the_avx2_cap():
    env = dict(os.environ, MIXBITS_ISA="avx2")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        *[str(HERE / f) for f in KERNEL_SUITES]],
                       env=env, capture_output=True, text=True, timeout=1200, cwd=HERE.parent)
    lines = r.stdout.splitlines()
    tail = "\n".join(lines[-15:])
    assert r.returncode == 0, tail
    assert " passed" in lines[-1] and "failed" not in lines[-1] and "error" not in lines[-1], tail
    # The one skip allowed: the check that auto takes VNNI, which the cap removes.
    skips = [line for line in lines if line.startswith("SKIPPED")]
    assert all("no AVX512-VNNI on this CPU" in line for line in skips), tail
