"""Builds the Metal-kernel emulator library with g++ and calls it via ctypes.

The .metal sources (metal/) are compiled unchanged as C++ through
tests/metal/metal_compat.h and linked with the SIMT emulator and the
launch harness into one shared library. The build is cached under
build/metal-emu/<hash of every source, the flags and the compiler>/, so only
a change to a kernel, header or emulator file rebuilds it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
METAL_DIR = ROOT / "metal"
EMU_DIR = ROOT / "tests" / "metal"
BUILD_ROOT = ROOT / "build" / "metal-emu"

UNITS = ["simt.cpp", "harness.cpp", "harness_gather.cpp", "harness_t.cpp",
         "harness_gather_t.cpp", "emu_qmv.cpp", "emu_qmv_t.cpp", "emu_qmm.cpp",
         "emu_gather.cpp", "emu_gather_qmm.cpp", "emu_gather_t.cpp", "emu_kl.cpp",
         "emu_selftest.cpp", "harness_fp.cpp", "emu_fp.cpp"]
FLAGS = [
    "-std=c++20", "-O2", "-fPIC", "-pthread", "-Wall", "-Wextra",
    "-Wno-unknown-pragmas", "-Wno-register", "-Wno-unused-parameter",
    f"-I{METAL_DIR}", f"-I{EMU_DIR}",
]

# The units holding the kernels are instrumented: GCC's ThreadSanitizer pass
# calls a hook (defined in simt.cpp, no TSan runtime linked) with the
# address and width of every memory access, which counts device and
# threadgroup traffic (simt.h). The passes that would merge or widen the
# kernels' own loads (byte loads into one word, scalar loads into vectors)
# are off, so a load is counted at the width the kernel source wrote.
KERNEL_FLAGS = ["-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0",
                "-fno-expensive-optimizations", "-fno-store-merging", "-fno-tree-vectorize"]

ACT_TYPES = {"float32": 0, "float16": 1, "bfloat16": 2}
ORDERS = {"forward": 0, "reverse": 1, "shuffle": 2}
PATHS = {"auto": 0, "gemv": 1, "tiled": 2}


class EmulatorError(RuntimeError):
    """A kernel broke a synchronization rule, or the launch failed."""


def compiler() -> str | None:
    cxx = os.environ.get("CXX", "g++")
    return shutil.which(cxx)


def _sources() -> list[Path]:
    files = sorted(METAL_DIR.glob("*.h")) + sorted(METAL_DIR.glob("*.metal"))
    files += sorted(EMU_DIR.glob("*.h")) + sorted(EMU_DIR.glob("*.cpp"))
    files += sorted(EMU_DIR.glob("*.metal"))
    return files


def build_key(cxx: str, flags: list[str], sources: list[Path]) -> str:
    """A build's cache key: compiler version, flags and every source's name and bytes."""
    h = hashlib.sha256()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    h.update(version.encode())
    h.update(" ".join(flags).encode())
    for f in sources:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def build_library(root: Path, name: str, cxx: str, flags: list[str], units: list[Path],
                  sources: list[Path], keep: int | None = None) -> Path:
    """``root/<key>/name``, a shared library of ``units`` (the emu_* ones
    with KERNEL_FLAGS as well), built unless a cached build of the same
    compiler, flags and ``sources`` exists. Concurrent test runs build
    once (a lock); a half-built directory is never seen (built aside,
    then renamed). ``keep``: after a build, drop all but that many
    newest builds under ``root``."""
    lib = root / build_key(cxx, flags + KERNEL_FLAGS, sources) / name
    if lib.exists():
        return lib
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():
            return lib
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
        try:
            def compile_unit(unit: Path) -> Path:
                obj = tmp / (unit.stem + ".o")
                extra = KERNEL_FLAGS if unit.name.startswith("emu_") else []
                r = subprocess.run([cxx, *flags, *extra, "-c", str(unit), "-o", str(obj)],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    raise RuntimeError(f"compiling {unit.name} failed:\n{r.stderr[-8000:]}")
                return obj

            with ThreadPoolExecutor(max(1, min(len(units), os.cpu_count() or 1))) as pool:
                objs = list(pool.map(compile_unit, units))
            r = subprocess.run([cxx, "-shared", "-pthread", *map(str, objs), "-o", str(tmp / name)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"linking {name} failed:\n{r.stderr[-8000:]}")
            os.replace(tmp, lib.parent)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        if keep is not None:
            _prune(root, keep)
    return lib


def build() -> Path:
    """Path of the emulator library, building it if no cached build matches."""
    cxx = compiler()
    if cxx is None:
        raise FileNotFoundError("no C++ compiler (g++ or $CXX) on PATH")
    return build_library(BUILD_ROOT, "libmbemu.so", cxx, FLAGS, [EMU_DIR / u for u in UNITS], _sources(),
                         keep=3)


def _prune(root: Path, keep: int) -> None:
    """Drop all but the `keep` newest cached builds (older source states)."""
    builds = sorted((d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")),
                    key=lambda d: d.stat().st_mtime, reverse=True)
    for d in builds[keep:]:
        shutil.rmtree(d, ignore_errors=True)


_LIB = None


def lib() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        L = ctypes.CDLL(str(build()))
        P, I, U64, Z = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_size_t
        L.mbemu_qmm.argtypes = [I, I, I, P, P, P, I, P, Z, P, Z, P, P, P, P, P, P, I, P, Z,
                                I, I, U64, ctypes.c_char_p, I]
        L.mbemu_gather.argtypes = [I, I, I, I, I, I, P, P, P, I, P, Z, P, Z, P, P, P, P,
                                   P, P, I, P, Z, P, Z, P, Z, I, I, U64, ctypes.c_char_p, I]
        L.mbemu_gather_kernel.argtypes = [I, I, I, I, ctypes.c_char_p, I, ctypes.c_char_p, I]
        L.mbemu_qmv_t.argtypes = [I, I, I, P, P, P, I, P, Z, P, Z, P, P, P, P, P, P, I, P, Z,
                                  I, U64, ctypes.c_char_p, I]
        L.mbemu_gather_t.argtypes = [I, I, I, I, I, I, P, P, P, I, P, Z, P, Z, P, P, P, P,
                                     P, P, I, P, Z, P, Z, P, Z, I, I, U64, ctypes.c_char_p, I]
        L.mbemu_gather_t_applies.argtypes = [ctypes.c_int64] * 7
        L.mbemu_gather_t_fusable.argtypes = [I, I, I]
        L.mbemu_kl.argtypes = [I, I, I, I, I, I, P, P, I, U64, ctypes.c_char_p, I]
        L.mbemu_selftest.argtypes = [ctypes.c_char_p, I, I, P, P, I, I, U64,
                                     ctypes.c_char_p, I]
        L.mbemu_fp_qmv.argtypes = [I, I, I, I, I, P, Z, P, Z, P, Z, P, Z, I, U64,
                                   ctypes.c_char_p, I]
        L.mbemu_fp_qmv_kernel.argtypes = [I, I, I, I, I, ctypes.c_char_p, I, ctypes.c_char_p, I]
        L.mbemu_fp_qmv.restype = L.mbemu_fp_qmv_kernel.restype = I
        L.mbemu_kernel_count.argtypes = []
        L.mbemu_traffic_begin.argtypes = []
        L.mbemu_traffic_end.argtypes = []
        L.mbemu_traffic_records.argtypes = []
        L.mbemu_traffic_record.argtypes = [I, P, I, ctypes.c_char_p, I]
        L.mbemu_traffic_begin.restype = L.mbemu_traffic_end.restype = None
        for f in (L.mbemu_qmm, L.mbemu_gather, L.mbemu_gather_kernel, L.mbemu_qmv_t,
                  L.mbemu_gather_t, L.mbemu_gather_t_applies, L.mbemu_gather_t_fusable,
                  L.mbemu_kl, L.mbemu_selftest,
                  L.mbemu_kernel_count, L.mbemu_traffic_records, L.mbemu_traffic_record):
            f.restype = I
        _LIB = L
    return _LIB


def _ptr(a: np.ndarray | None):
    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


def _check(rc: int, err: ctypes.Array) -> None:
    if rc != 0:
        raise EmulatorError(err.value.decode(errors="replace"))


def _segment_args(specs, arrays):
    """The per-segment C arguments every kernel entry point takes: int32
    arrays of bits, group sizes and k from specs ((bits, group_size, k) per
    segment), and pointer and byte-size arrays of wq, scales and biases from
    arrays (three per segment, contiguous; the caller keeps them alive)."""
    n = len(specs)
    bits, gs, ks = (np.array([s[j] for s in specs], dtype=np.int32) for j in range(3))
    ptrs = [(ctypes.c_void_p * n)() for _ in range(3)]
    sizes = [(ctypes.c_size_t * n)() for _ in range(3)]
    for i in range(n):
        for j in range(3):
            a = arrays[3 * i + j]
            ptrs[j][i], sizes[j][i] = a.ctypes.data, a.nbytes
    return bits, gs, ks, ptrs, sizes


# ---------------------------------------------------------------- dtypes

def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def storage_to_f64(a: np.ndarray, act: str) -> np.ndarray:
    if act == "bfloat16":
        return bf16_to_f32(a).astype(np.float64)
    return a.astype(np.float64)


def storage_dtype(act: str):
    return {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[act]


# ---------------------------------------------------------------- kernels

def qmatmul(x: np.ndarray, act: str, segments, N: int, perm=None, scale_type: str = "float32",
            path: str = "auto", order: str = "shuffle", seed: int = 1) -> np.ndarray:
    """Run the Metal quantized matmul on the emulator.

    x: [M, K] storage array of `act` (bfloat16 as uint16 bits);
    segments: list of (bits, group_size, k, wq uint32, scales, biases) with
    scales/biases as storage arrays of `scale_type`. Returns [M, N] storage.
    """
    x = np.ascontiguousarray(x)
    M, K = x.shape
    n = len(segments)
    keep = [np.ascontiguousarray(a) for seg in segments for a in seg[3:]]
    bits, gs, ks, ptrs, sizes = _segment_args(segments, keep)
    assert ks.sum() == K
    perm_a = None if perm is None else np.ascontiguousarray(perm, dtype=np.int32)
    out = np.zeros((M, N), dtype=storage_dtype(act))
    err = ctypes.create_string_buffer(2048)
    rc = lib().mbemu_qmm(M, N, n, _ptr(bits), _ptr(gs), _ptr(ks), ACT_TYPES[act], _ptr(x),
                         x.nbytes, _ptr(perm_a), 0 if perm_a is None else perm_a.nbytes,
                         ptrs[0], sizes[0], ptrs[1], sizes[1], ptrs[2], sizes[2],
                         ACT_TYPES[scale_type], _ptr(out), out.nbytes, PATHS[path],
                         ORDERS[order], seed, err, len(err))
    _check(rc, err)
    return out


def gather(inputs, segments, act: str, scale_type: str, has_perm: bool,
           sorted_indices: bool = False, order: str = "shuffle", seed: int = 1) -> np.ndarray:
    """Run the Metal gathered matmul on the emulator with MixedGatherQMM's own
    inputs, in the node's order: x [Bx..., M, K], [perm [K]], (wq, scales,
    biases) per segment stacked [Bw..., N, .], lhs, rhs (uint32, one shape),
    as storage arrays (bfloat16 as uint16 bits). segments: (bits,
    group_size, k) per segment; sorted_indices: the node's flag, which with
    the shapes picks the GEMV or the tiled kernel as eval_gpu does
    (gather_host.h). The shapes are read off the arrays as eval_gpu reads
    them; the harness refuses a buffer of another size than the launch
    binds. Returns lhs.shape + (M, N) storage."""
    inputs = [np.ascontiguousarray(a) for a in inputs]
    first = 2 if has_perm else 1
    x, lhs, rhs = inputs[0], inputs[-2], inputs[-1]
    perm = inputs[1].view(np.int32) if has_perm else None  # uint32: same bits
    packed = inputs[first:-2]
    assert len(packed) == 3 * len(segments)
    for name, a in (("lhs", lhs), ("rhs", rhs)):
        if a.dtype != np.uint32:
            raise TypeError(f"{name} must be uint32, as the primitive holds it, got {a.dtype}")
    if lhs.shape != rhs.shape:
        raise ValueError("lhs and rhs must have one shape (the builder broadcasts them)")
    M, K = x.shape[-2:]
    N = packed[0].shape[-2]
    Bx = int(np.prod(x.shape[:-2], dtype=np.int64))
    Bw = int(np.prod(packed[0].shape[:-2], dtype=np.int64))
    P = lhs.size
    n = len(segments)
    bits, gs, ks, ptrs, sizes = _segment_args(segments, packed)
    out = np.zeros((P, M, N), dtype=storage_dtype(act))
    err = ctypes.create_string_buffer(2048)
    rc = lib().mbemu_gather(
        P, M, N, Bx, Bw, n, _ptr(bits), _ptr(gs), _ptr(ks), ACT_TYPES[act], _ptr(x), x.nbytes,
        _ptr(perm), 0 if perm is None else perm.nbytes, ptrs[0], sizes[0], ptrs[1], sizes[1],
        ptrs[2], sizes[2], ACT_TYPES[scale_type], _ptr(lhs), lhs.nbytes, _ptr(rhs), rhs.nbytes,
        _ptr(out), out.nbytes, int(sorted_indices), ORDERS[order], seed, err, len(err))
    _check(rc, err)
    return out.reshape(lhs.shape + (M, N))


def gather_kernel(pairs: int, M: int, sorted_indices: bool, w_batches: int = 1) -> str:
    """The kernel MixedGatherQMM::eval_gpu launches for `pairs` output
    matrices of M rows (gather_host.h's choice)."""
    name = ctypes.create_string_buffer(256)
    err = ctypes.create_string_buffer(2048)
    _check(lib().mbemu_gather_kernel(pairs, M, int(sorted_indices), w_batches, name, len(name), err,
                                     len(err)), err)
    return name.value.decode()


def qmv_t(inputs, segments, act: str, scale_type: str, has_perm: bool,
          order: str = "shuffle", seed: int = 1) -> np.ndarray:
    """Run the Metal transposed product dx = dy · W (un-permuted) on the
    emulator with MixedQMatmulT's own inputs, in the node's order: dy
    [..., N], [perm [K]], (wq, scales, biases) per segment, as storage
    arrays (bfloat16 as uint16 bits). segments: (bits, group_size, k) per
    segment. Shapes are read off the arrays as eval_gpu reads them; the
    harness refuses a buffer of another size than the launch binds.
    Returns dy.shape[:-1] + (K,) storage."""
    inputs = [np.ascontiguousarray(a) for a in inputs]
    first = 2 if has_perm else 1
    dy = inputs[0]
    perm = inputs[1].view(np.int32) if has_perm else None  # uint32: same bits
    packed = inputs[first:]
    assert len(packed) == 3 * len(segments)
    N = packed[0].shape[0]
    K = sum(int(s[2]) for s in segments)
    M = dy.size // N if N else int(np.prod(dy.shape[:-1], dtype=np.int64))
    n = len(segments)
    bits, gs, ks, ptrs, sizes = _segment_args(segments, packed)
    out = np.zeros((M, K), dtype=storage_dtype(act))
    err = ctypes.create_string_buffer(2048)
    rc = lib().mbemu_qmv_t(
        M, N, n, _ptr(bits), _ptr(gs), _ptr(ks), ACT_TYPES[act], _ptr(dy), dy.nbytes,
        _ptr(perm), 0 if perm is None else perm.nbytes, ptrs[0], sizes[0], ptrs[1], sizes[1],
        ptrs[2], sizes[2], ACT_TYPES[scale_type], _ptr(out), out.nbytes, ORDERS[order], seed,
        err, len(err))
    _check(rc, err)
    return out.reshape(dy.shape[:-1] + (K,))


def gather_t(inputs, segments, act: str, scale_type: str, has_perm: bool, x_batches: int,
             order: str = "shuffle", seed: int = 1, fused: bool | None = None) -> np.ndarray:
    """Run the Metal gathered transposed product dx[lhs[i]] += dy[i] · W[rhs[i]]
    (un-permuted) on the emulator with MixedGatherQMMT's own inputs, in the
    node's order: dy [pairs..., M, N], [perm [K]], (wq, scales, biases) per
    segment stacked [Bw..., N, .], lhs, rhs (uint32, dy's batch shape), as
    storage arrays (bfloat16 as uint16 bits). x_batches: the dx matrices
    (the node's output shape, which no input carries). Shapes are read off
    the arrays as eval_gpu reads them; the harness refuses a buffer of
    another size than a launch binds. fused: None the host plan's choice
    (gt_fused), False the grouping launch and the product, True the product
    alone. Returns [x_batches, M, K] storage."""
    inputs = [np.ascontiguousarray(a) for a in inputs]
    first = 2 if has_perm else 1
    dy, lhs, rhs = inputs[0], inputs[-2], inputs[-1]
    perm = inputs[1].view(np.int32) if has_perm else None  # uint32: same bits
    packed = inputs[first:-2]
    assert len(packed) == 3 * len(segments)
    for name, a in (("lhs", lhs), ("rhs", rhs)):
        if a.dtype != np.uint32:
            raise TypeError(f"{name} must be uint32, as the primitive holds it, got {a.dtype}")
    M, N = dy.shape[-2:]
    K = sum(int(s[2]) for s in segments)
    Bw = int(np.prod(packed[0].shape[:-2], dtype=np.int64))
    bits, gs, ks, ptrs, sizes = _segment_args(segments, packed)
    out = np.zeros((x_batches, M, K), dtype=storage_dtype(act))
    err = ctypes.create_string_buffer(2048)
    rc = lib().mbemu_gather_t(
        lhs.size, M, N, x_batches, Bw, len(segments), _ptr(bits), _ptr(gs), _ptr(ks),
        ACT_TYPES[act], _ptr(dy), dy.nbytes, _ptr(perm), 0 if perm is None else perm.nbytes,
        ptrs[0], sizes[0], ptrs[1], sizes[1], ptrs[2], sizes[2], ACT_TYPES[scale_type],
        _ptr(lhs), lhs.nbytes, _ptr(rhs), rhs.nbytes, _ptr(out), out.nbytes,
        -1 if fused is None else int(fused), ORDERS[order], seed, err, len(err))
    _check(rc, err)
    return out


def gather_t_applies(pairs: int, M: int, N: int, K: int, x_batches: int,
                     w_batches: int, nseg: int = 1) -> bool:
    """Whether the gathered transposed kernels take a problem (gather_t_host.h;
    on a GPU stream the gradient is dequantize + gather_mm otherwise)."""
    return bool(lib().mbemu_gather_t_applies(pairs, M, N, K, x_batches, w_batches, nseg))


def gather_t_fusable(pairs: int, K: int, has_perm: bool) -> bool:
    """Whether the fused product (one dispatch, fused=True) can take a
    problem at all (gt_fusable in gather_t_host.h: the pairs its
    threadgroups list, a perm within the dense kernel's K-bit map); the plan
    refuses a forced fused=True otherwise, and the host's choice (gt_fused)
    also weighs the re-reads."""
    return bool(lib().mbemu_gather_t_fusable(pairs, K, int(has_perm)))


KL_MODES = {"logits": 0, "fixed_shift": 1, "probs": 2}
KL_OUTPUTS = ("kl", "status", "argmax_q", "lse_q", "argmax_ref", "lse_ref")


def kl(a: np.ndarray, b: np.ndarray, a_act: str, b_act: str | None = None,
       mode: str = "logits", row_param: np.ndarray | None = None, threads: int = 256,
       order: str = "shuffle", seed: int = 1) -> dict:
    """Run the Metal KL kernel on the emulator over rows of a (reference) and
    b (candidate logits); returns the six per-row outputs by name.

    row_param is passed exactly as given (float32, any shape): the harness
    refuses it unless its size is what the launch binds, the CPU primitive's
    layout ([rows] shift in fixed_shift mode, [rows, 2] negH hi + lo in
    probs mode)."""
    b_act = b_act or a_act
    a = np.ascontiguousarray(a)
    b = np.ascontiguousarray(b)
    assert a.shape == b.shape and a.ndim == 2
    rows, V = a.shape
    rp = None if row_param is None else np.ascontiguousarray(row_param)
    if rp is not None and rp.dtype != np.float32:
        raise TypeError("row_param must be float32, as the primitive passes it")
    res = {k: np.zeros(rows, np.float32 if k in ("kl", "lse_q", "lse_ref") else np.int32)
           for k in KL_OUTPUTS}
    arrays = [a, b, rp] + [res[k] for k in KL_OUTPUTS]
    bufs = (ctypes.c_void_p * len(arrays))(*[None if x is None else x.ctypes.data
                                             for x in arrays])
    sizes = (ctypes.c_size_t * len(arrays))(*[0 if x is None else x.nbytes for x in arrays])
    err = ctypes.create_string_buffer(2048)
    rc = lib().mbemu_kl(rows, V, ACT_TYPES[a_act], ACT_TYPES[b_act], KL_MODES[mode], threads,
                        bufs, sizes, ORDERS[order], seed, err, len(err))
    _check(rc, err)
    return res


def selftest(name: str, inp: np.ndarray, groups: int, threads: int, out_len: int,
             order: str = "shuffle", seed: int = 1) -> np.ndarray:
    inp = np.ascontiguousarray(inp, dtype=np.float32)
    assert inp.size == groups * threads
    out = np.zeros(out_len, np.float32)
    err = ctypes.create_string_buffer(2048)
    rc = lib().mbemu_selftest(name.encode(), groups, threads, _ptr(inp), _ptr(out), out_len,
                              ORDERS[order], seed, err, len(err))
    _check(rc, err)
    return out


FP_MODES = {"mxfp4": 0, "nvfp4": 1, "mxfp8": 2}
FP_MODE_BITS = {"mxfp4": 4, "nvfp4": 4, "mxfp8": 8}


def fp_qmv(x: np.ndarray, act: str, wq: np.ndarray, scales: np.ndarray, mode: str,
           order: str = "shuffle", seed: int = 1) -> np.ndarray:
    """Run the fp-mode GEMV (metal/fp_qmv.metal) on the emulator with
    FpQMatmul's inputs: x [M, K] storage of `act` (bfloat16 as uint16 bits),
    wq uint32 [N, K*bits/32] and scales uint8 [N, K/group] as mx.quantize
    stores them. Shapes are read off the arrays as eval_gpu reads them; the
    harness refuses a buffer of another size than the launch binds.
    Returns [M, N] storage."""
    x, wq, scales = (np.ascontiguousarray(a) for a in (x, wq, scales))
    M, K = x.shape
    N = wq.shape[0]
    out = np.zeros((M, N), dtype=storage_dtype(act))
    err = ctypes.create_string_buffer(2048)
    rc = lib().mbemu_fp_qmv(M, N, K, FP_MODES[mode], ACT_TYPES[act], _ptr(x), x.nbytes, _ptr(wq),
                            wq.nbytes, _ptr(scales), scales.nbytes, _ptr(out), out.nbytes,
                            ORDERS[order], seed, err, len(err))
    _check(rc, err)
    return out


def fp_qmv_kernel(M: int, N: int, K: int, mode: str, act: str) -> str:
    """The kernel FpQMatmul::eval_gpu launches (fp_qmv_host.h); EmulatorError
    when the GEMV does not take the problem."""
    name = ctypes.create_string_buffer(256)
    err = ctypes.create_string_buffer(2048)
    _check(lib().mbemu_fp_qmv_kernel(M, N, K, FP_MODES[mode], ACT_TYPES[act], name, len(name),
                                     err, len(err)), err)
    return name.value.decode()


def kernel_count() -> int:
    return lib().mbemu_kernel_count()


# ---------------------------------------------------------------- traffic

WIDTHS = ("1", "2", "4", "8", "16", "other")


def _traffic_records(L: ctypes.CDLL | None = None) -> list[dict]:
    L = L or lib()
    out = []
    for i in range(L.mbemu_traffic_records()):
        v = np.zeros(26, np.uint64)
        label = ctypes.create_string_buffer(256)
        if L.mbemu_traffic_record(i, _ptr(v), 26, label, len(label)) != 0:
            raise EmulatorError(f"traffic record {i} unreadable")
        v = [int(a) for a in v]
        rd, wr = v[7:13], v[13:19]
        out.append({
            "kernel": label.value.decode(), "threads": v[0], "grid": v[1:4], "group": v[4:7],
            "device_read_bytes": sum(rd), "device_write_bytes": sum(wr),
            "device_read_by_width": dict(zip(WIDTHS, rd)),
            "device_write_by_width": dict(zip(WIDTHS, wr)),
            "threadgroup_read_bytes": v[19], "threadgroup_write_bytes": v[20],
            "barriers": v[21], "simdgroup_barriers": v[22], "mma": v[23],
            "device_unique_read_bytes": v[24], "device_unique_write_bytes": v[25]})
    return out


@contextlib.contextmanager
def counting(L: ctypes.CDLL | None = None):
    """Records every dispatch run inside the block; yields a list that holds
    one dict per dispatch (kernel, threads, device bytes read and written by
    access width, distinct device bytes read and written, threadgroup
    bytes, barriers, simdgroup barriers, 8x8x8 MMAs) once the block ends."""
    L = L or lib()  # another library built on simt.cpp + harness.cpp (mlx_emu)
    records: list[dict] = []
    L.mbemu_traffic_begin()
    try:
        yield records
    finally:
        L.mbemu_traffic_end()
        records.extend(_traffic_records(L))
