"""Cross-compile CPU kernels for aarch64 and run them under qemu-user: how
the NEON backends (the CPU path of a Mac) are checked on an x86 machine.

Needs ``aarch64-linux-gnu-g++`` and ``qemu-aarch64`` (Debian/Ubuntu:
``apt-get install g++-aarch64-linux-gnu qemu-user``; .ci/run installs
them). Missing tools skip the NEON tests with that reason on a developer's
machine and fail them under CI (CI=true), so CI never passes without
running them. qemu checks results, not speed."""

import os
import shutil
import struct
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which("aarch64-linux-gnu-g++")
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
# Every Apple M-series core has the dot-product extension (Apple clang
# targets it by default); qemu's "max" CPU emulates it.
ARCH_FLAGS = ["-march=armv8.2-a+dotprod"]


def require_tools():
    if CXX and QEMU:
        return
    why = "aarch64 cross compiler or qemu-user not installed (apt-get install g++-aarch64-linux-gnu qemu-user)"
    if os.environ.get("CI"):
        pytest.fail("CI must run the NEON checks: " + why)
    pytest.skip(why)


def build(exe: Path, sources, defines=("MIXBITS_HAVE_NEON=1",), arch=ARCH_FLAGS) -> Path:
    """Static aarch64 executable from repo-relative sources."""
    require_tools()
    # -ffp-contract=off as CMakeLists.txt compiles the NEON sources.
    cmd = [CXX, "-std=c++20", "-O2", "-ffp-contract=off", "-static", "-pthread", *arch,
           *(f"-D{d}" for d in defines), f"-I{ROOT / 'cpp'}",
           *(str(ROOT / s) for s in sources), "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, "cross compile failed:\n" + r.stderr[-4000:]
    return exe


def run(exe: Path, *args, threads: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, MIXBITS_NUM_THREADS=str(threads))
    return subprocess.run([QEMU, "-cpu", "max", str(exe), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)


# ------------------------------------------------ quantized-matmul harness

# What tests/neon/qmm_harness.cpp is linked from: the kernels an aarch64
# build of the extension compiles, with their dispatch.
QMM_SOURCES = [
    "tests/neon/qmm_harness.cpp",
    "cpp/common/backend.cpp", "cpp/common/cpu.cpp", "cpp/common/parallel.cpp",
    "cpp/qmatmul/ref.cpp", "cpp/qmatmul/dispatch.cpp", "cpp/qmatmul/neon.cpp", "cpp/qmatmul/neon_t.cpp",
    "cpp/qmatmul_int8/ref.cpp", "cpp/qmatmul_int8/dispatch.cpp", "cpp/qmatmul_int8/neon.cpp",
]
# An aarch64 CPU without the dot-product extension (the int8 kernel's
# other branch).
BASE_ARCH_FLAGS = ["-march=armv8-a"]
DTYPE_ID = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}
# kernel name -> kind (0: y = x W^T, 1: dx = dy W); see kKernels in the harness
KERNELS = {"ref": 0, "neon": 0, "int8_ref": 0, "int8": 0, "int16_ref": 0, "int16": 0,
           "t_ref": 1, "t_neon": 1}


def _raw(a: mx.array) -> bytes:
    """The buffer as MLX holds it (bfloat16 as its 16-bit pattern)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a).tobytes()


def write_cases(path: Path, cases) -> None:
    """cases: (kind, inp float32 [M, cols], QuantizedTensor without perm)."""
    with open(path, "wb") as f:
        f.write(b"MBQ1" + struct.pack("<I", len(cases)))
        for kind, inp, qt in cases:
            assert qt.perm is None and not qt.batch_shape
            N, K = qt.shape
            f.write(struct.pack("<6i", kind, inp.shape[0], N, K, DTYPE_ID[qt.segments[0].scales.dtype],
                                len(qt.segments)))
            for s in qt.segments:
                f.write(struct.pack("<3i", s.bits, s.group_size, s.k))
            f.write(np.ascontiguousarray(inp, np.float32).tobytes())
            for s in qt.segments:
                f.write(_raw(s.wq) + _raw(s.scales) + _raw(s.biases))


def run_qmm(exe: Path, tmp: Path, cases, names, threads: int = 1) -> list[dict]:
    """Per case {kernel name: float64 output} for the kernels of its kind."""
    write_cases(tmp / "cases.bin", cases)
    r = run(exe, tmp / "cases.bin", tmp / "out.bin", ",".join(names), threads=threads)
    assert r.returncode == 0, r.stdout + r.stderr
    flat = np.fromfile(tmp / "out.bin", np.float32).astype(np.float64)
    out, at = [], 0
    for kind, inp, qt in cases:
        M, (N, K) = inp.shape[0], qt.shape
        size = M * (N if kind == 0 else K)
        res = {}
        for n in names:
            if KERNELS[n] == kind:
                res[n] = flat[at:at + size].reshape(M, -1)
                at += size
        out.append(res)
    assert at == flat.size, "harness output has the wrong size"
    return out


# ------------------------------------------------ repacked-layout harness

# What tests/neon/repacked_harness.cpp is linked from: the repacked driver
# and kernels of an aarch64 build, with the contract's x quantization.
REPACKED_SOURCES = [
    "tests/neon/repacked_harness.cpp",
    "cpp/common/backend.cpp", "cpp/common/cpu.cpp", "cpp/common/parallel.cpp",
    "cpp/qmatmul_int8/ref.cpp", "cpp/qmatmul_int8/repacked_run.cpp",
    "cpp/qmatmul_int8/neon_repacked.cpp",
]
ACT_ID = {"int8": 1, "int16": 2}


def write_repacked_cases(path: Path, cases) -> None:
    """cases: (act, x float32 [M, K], RepackedTensor without perm, poison)."""
    with open(path, "wb") as f:
        f.write(b"MBR1" + struct.pack("<I", len(cases)))
        for act, x, rt, poison in cases:
            assert rt.perm is None
            N, K = rt.shape
            f.write(struct.pack("<7i", ACT_ID[act], x.shape[0], N, K, DTYPE_ID[rt.dtype], int(poison),
                                len(rt.segments)))
            for s in rt.segments:
                f.write(struct.pack("<3i", s.bits, s.group_size, s.k))
            f.write(np.ascontiguousarray(x, np.float32).tobytes())
            for s in rt.segments:
                f.write(_raw(s.wq_r) + _raw(s.scales_r) + _raw(s.biases_r))


def _outputs(exe: Path, tmp: Path, shapes, threads: int) -> list[np.ndarray]:
    """Runs a harness on tmp/cases.bin; its float32 outputs, one array per
    shape in order, as float64. A nonzero exit (no NEON table offered, a
    write past an output) fails with the harness's message."""
    r = run(exe, tmp / "cases.bin", tmp / "out.bin", threads=threads)
    assert r.returncode == 0, f"harness exit {r.returncode}: " + r.stdout + r.stderr
    flat = np.fromfile(tmp / "out.bin", np.float32).astype(np.float64)
    out, at = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        out.append(flat[at:at + size].reshape(shape))
        at += size
    assert at == flat.size, "harness output has the wrong size"
    return out


def run_repacked(exe: Path, tmp: Path, cases, threads: int = 1) -> list[np.ndarray]:
    """Per case the harness's y (float64 [M, N])."""
    write_repacked_cases(tmp / "cases.bin", cases)
    return _outputs(exe, tmp, [(x.shape[0], rt.shape[0]) for _, x, rt, _ in cases], threads)


# ------------------------------------------------ attention / SwiGLU harness

# What tests/neon/attn_harness.cpp is linked from: the attention driver and
# the attention and SwiGLU kernels of an aarch64 build, with their dispatch.
ATTN_SOURCES = [
    "tests/neon/attn_harness.cpp",
    "cpp/common/backend.cpp", "cpp/common/cpu.cpp", "cpp/common/parallel.cpp",
    "cpp/common/convert.cpp", "cpp/common/neon_convert.cpp", "cpp/kl/neon.cpp",
    "cpp/attn/driver.cpp", "cpp/attn/dispatch.cpp", "cpp/attn/ref.cpp", "cpp/attn/neon.cpp",
    "cpp/act/dispatch.cpp", "cpp/act/ref.cpp", "cpp/act/neon.cpp",
]


def _f32(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a, np.float32)).tobytes()


def write_attn_cases(path: Path, cases) -> None:
    """cases, each a tuple by op:
    ("attn", q, k_buf, v_buf, S, scale): q [B, H, T, D]; k_buf, v_buf
        [B, Hk, rows, D] MLX arrays of q's dtype whose first S rows per
        head are the keys (the rest is never to be read);
    ("attn_vjp", q, k, v, dout, scale): float32, rows = S;
    ("swiglu", g, u) and ("swiglu_vjp", g, u, dy): float32 of one size."""
    with open(path, "wb") as f:
        f.write(b"MBA1" + struct.pack("<I", len(cases)))
        for case in cases:
            op = case[0]
            if op in ("attn", "attn_vjp"):
                q, k, v = case[1:4]
                S = case[4] if op == "attn" else k.shape[2]
                B, H, T, D = q.shape
                f.write(struct.pack("<9i", 0 if op == "attn" else 1, DTYPE_ID[q.dtype], B, H,
                                    k.shape[1], T, S, D, k.shape[2]) + struct.pack("<f", case[-1]))
                f.write(_raw(q) + _raw(k) + _raw(v))
                if op == "attn_vjp":
                    f.write(_f32(case[4]))
            else:
                g = np.asarray(case[1], np.float32).ravel()
                f.write(struct.pack("<2i", 2 if op == "swiglu" else 3, g.size))
                f.write(b"".join(_f32(np.asarray(a).ravel()) for a in case[1:]))


def run_attn(exe: Path, tmp: Path, cases, threads: int = 1) -> list[tuple[np.ndarray, ...]]:
    """Per case the harness's outputs as float64 (out; dq, dk, dv; y; dg, du)."""
    write_attn_cases(tmp / "cases.bin", cases)
    per_case = [{"attn": [c[1].shape], "attn_vjp": [a.shape for a in c[1:4]],
                 "swiglu": [np.shape(c[1])], "swiglu_vjp": [np.shape(c[1])] * 2}[c[0]] for c in cases]
    flat = iter(_outputs(exe, tmp, [s for shapes in per_case for s in shapes], threads))
    return [tuple(next(flat) for _ in shapes) for shapes in per_case]
