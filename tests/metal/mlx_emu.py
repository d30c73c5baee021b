"""MLX's own affine quantized Metal kernels on the SIMT emulator.

The kernels are compiled from the headers the installed mlx package ships
(mlx/include/mlx/backend/metal/kernels/quantized.h and the steel loader /
MMA headers), so the comparison always runs the pinned MLX version's source;
nothing of MLX's is copied into this repository. What they need beyond
metal_compat.h is in mlx_shim/mlx_compat.h and mlx_shim/stub/. A missing header is an
error, never a skip.

`plan` transcribes MLX's host choice (mlx/backend/metal/quantized.cpp,
QuantizedMatmul::eval_gpu for a transposed 2-D weight) of kernel, grid and
threadgroup for the shapes compared here; `run` launches it and returns y.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import numpy as np

import metal_emu as E

BUILD_ROOT = E.ROOT / "build" / "mlx-emu"
# Its own folder, so that metal_emu's build (which hashes tests/metal/*) does
# not depend on these files.
# Not "mlx": a folder of that name beside the tests would shadow the mlx package.
MLX_DIR = E.EMU_DIR / "mlx_shim"
STUB_DIR = MLX_DIR / "stub"
UNITS = [E.EMU_DIR / "simt.cpp", E.EMU_DIR / "harness.cpp", MLX_DIR / "harness_mlx.cpp",
         MLX_DIR / "emu_mlx.cpp"]
# MLX's steel MMA reads a simdgroup matrix's elements through a reference to
# another type (thread_elements()); keep GCC from reordering around it.
MLX_FLAGS = ["-fno-strict-aliasing"]


def mlx_include() -> Path:
    """The installed mlx package's C++ include directory, with the Metal
    kernel headers the comparison compiles; raises if any is missing."""
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the mlx package is not installed (its Metal kernel headers "
                                "are what tests/metal/mlx_emu.py compiles)")
    for loc in spec.submodule_search_locations:
        inc = Path(loc) / "include"
        kern = inc / "mlx" / "backend" / "metal" / "kernels"
        need = [kern / "quantized.h", kern / "quantized_utils.h",
                kern / "steel" / "gemm" / "loader.h", kern / "steel" / "gemm" / "mma.h"]
        if all(p.exists() for p in need):
            return inc
    raise FileNotFoundError(f"mlx's Metal kernel headers (quantized.h, steel/gemm/*.h) are not "
                            f"under {list(spec.submodule_search_locations)}/include")


def _sources(inc: Path) -> list[Path]:
    mlx_hdrs = sorted((inc / "mlx" / "backend" / "metal" / "kernels").rglob("*.h"))
    return E._sources() + sorted(p for p in MLX_DIR.rglob("*") if p.is_file()) + mlx_hdrs


def build() -> Path:
    cxx = E.compiler()
    if cxx is None:
        raise FileNotFoundError("no C++ compiler (g++ or $CXX) on PATH")
    inc = mlx_include()
    flags = E.FLAGS + [f"-I{MLX_DIR}", f"-I{STUB_DIR}", f"-I{inc}"] + MLX_FLAGS
    return E.build_library(BUILD_ROOT, "libmlxemu.so", cxx, flags, UNITS, _sources(inc))


_LIB = None


def lib() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        L = ctypes.CDLL(str(build()))
        P, I, U64, S = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_char_p
        U3 = ctypes.POINTER(ctypes.c_uint32)
        L.mbmlx_qmv.argtypes = [S, I, I, I, I, U3, U3, P, P, P, P, P, I, U64, S, I]
        L.mbmlx_qmm_t.argtypes = [S, I, I, I, U3, U3, P, P, P, P, P, I, U64, S, I]
        L.mbmlx_qmm_t_splitk.argtypes = [S, I, I, I, I, U3, U3, P, P, P, P, P, I, U64, S, I]
        L.mbemu_traffic_begin.argtypes = L.mbemu_traffic_end.argtypes = []
        L.mbemu_traffic_records.argtypes = []
        L.mbemu_traffic_record.argtypes = [I, P, I, S, I]
        L.mbemu_traffic_begin.restype = L.mbemu_traffic_end.restype = None
        for f in (L.mbmlx_qmv, L.mbmlx_qmm_t, L.mbmlx_qmm_t_splitk, L.mbemu_traffic_records,
                  L.mbemu_traffic_record):
            f.restype = I
        _LIB = L
    return _LIB


# ---------------------------------------------------------------- host choice

# GPU families whose choice differs for these shapes (quantized.cpp:
# get_qmv_batch_limit, use_qmv_wide): Apple GPU generation 13/14 (M1, M2;
# not Ultra) and 15/16 (M3, M4; not Ultra). Generation 17 (M5) takes the
# NAX kernels for the tiled case, which the emulator does not model.
GPUS = ("m1m2", "m3m4")


def _vector_limit(K: int, N: int, gpu: str) -> int:
    small, mid = K <= 2048 and N <= 2048, K <= 4096 and N <= 4096
    if gpu == "m3m4":
        return 13 if small else 15 if mid else 13
    return 14 if small else 10 if mid else 6


def plan(M: int, N: int, K: int, gpu: str = "m1m2", split_k: int | None = None) -> dict:
    """MLX's kernel, grid and threadgroup for y = x W^T, x [M, K] float16, W
    4-bit group 64 [N, K] (2-D, so unbatched). Keys: kernel, kind (qmv,
    qmv_wide, qmm_t, qmm_t_splitk), grid, group, split_k (tiled only), note.
    split_k: use this split instead of MLX's choice for this shape (for a
    scaled-down run of a shape where MLX would split differently)."""
    split_k_arg = split_k
    if gpu not in GPUS:
        raise ValueError(f"gpu must be one of {GPUS}, got {gpu!r}")
    if K % 64 or N % 8:
        raise ValueError("the comparison covers K % 64 == 0 and N % 8 == 0 only")
    if M >= _vector_limit(K, N, gpu):
        # qmm_splitk: split_k aimed at ~512 threadgroups, K split in whole
        # groups; split_k <= 1 falls through to qmm (qmm_t, transposed W).
        n_tiles, m_tiles = -(-N // 32), -(-M // 32)
        split_k = min(max(1, 512 // (n_tiles * m_tiles)), K // 64)
        while split_k > 1 and K % (split_k * 64):
            split_k -= 1
        if split_k_override := split_k_arg:
            split_k = split_k_override
        aligned = "true" if N % 32 == 0 else "false"
        if split_k <= 1:
            return {"kernel": f"affine_qmm_t_float16_t_gs_64_b_4_alN_{aligned}_batch_0",
                    "kind": "qmm_t", "grid": (n_tiles, m_tiles, 1), "group": (32, 2, 2),
                    "note": "", "split_k": 1}
        return {"kernel": f"affine_qmm_t_splitk_float16_t_gs_64_b_4_alN_{aligned}",
                "kind": "qmm_t_splitk", "grid": (n_tiles, m_tiles, split_k),
                "group": (32, 2, 2), "split_k": split_k,
                "note": f"then MLX's strided sum of the float32 [{split_k}, M, N] partials "
                        "(not emulated; its bytes counted analytically, reduce_record)"}
    if M >= 2 and gpu == "m3m4":
        n_tiles = (M + 4) // 5
        vecs = -(-M // n_tiles)
        return {"kernel": f"affine_qmv_wide_float16_t_gs_64_b_4_nv_{vecs}_kl_8_batch_0",
                "kind": "qmv_wide", "grid": (-(-M // vecs), -(-N // 8), 1), "group": (32, 2, 1),
                "note": ""}
    fast = K % 512 == 0  # qmv_fast_k_alignment(4) = 8 * 2 * 32; N % 8 checked above
    return {"kernel": f"affine_qmv{'_fast' if fast else ''}_float16_t_gs_64_b_4_batch_0",
            "kind": "qmv", "grid": (M, -(-N // 8), 1), "group": (32, 2, 1), "note": ""}


def run(x: np.ndarray, wq: np.ndarray, scales: np.ndarray, biases: np.ndarray,
        gpu: str = "m1m2", order: str = "shuffle", seed: int = 1,
        split_k: int | None = None) -> np.ndarray:
    """y = x W^T by the MLX kernel `plan` picks. x [M, K] float16, wq uint32
    [N, K / 8], scales and biases float16 [N, K / 64] (mx.quantize's
    layout). Returns y [M, N] float16."""
    x = np.ascontiguousarray(x, dtype=np.float16)
    wq, scales, biases = (np.ascontiguousarray(a) for a in (wq, scales, biases))
    M, K = x.shape
    N = wq.shape[0]
    if wq.dtype != np.uint32 or wq.shape != (N, K // 8):
        raise ValueError(f"wq must be uint32 [{N}, {K // 8}], got {wq.dtype} {wq.shape}")
    for name, a in (("scales", scales), ("biases", biases)):
        if a.dtype != np.float16 or a.shape != (N, K // 64):
            raise ValueError(f"{name} must be float16 [{N}, {K // 64}], got {a.dtype} {a.shape}")
    p = plan(M, N, K, gpu, split_k)
    grid = (ctypes.c_uint32 * 3)(*p["grid"])
    group = (ctypes.c_uint32 * 3)(*p["group"])
    y = np.zeros((M, N), np.float16)
    err = ctypes.create_string_buffer(2048)
    ptr = E._ptr
    if p["kind"] == "qmm_t_splitk":
        part = np.zeros((p["split_k"], M, N), np.float32)
        rc = lib().mbmlx_qmm_t_splitk(p["kernel"].encode(), M, N, K, p["split_k"], grid, group,
                                      ptr(wq), ptr(scales), ptr(biases), ptr(x), ptr(part),
                                      E.ORDERS[order], seed, err, len(err))
        E._check(rc, err)
        acc = part[0].copy()  # the strided sum over partitions, in float32
        for i in range(1, p["split_k"]):
            acc += part[i]
        return acc.astype(np.float16)
    if p["kind"] == "qmm_t":
        rc = lib().mbmlx_qmm_t(p["kernel"].encode(), M, N, K, grid, group, ptr(wq),
                               ptr(scales), ptr(biases), ptr(x), ptr(y), E.ORDERS[order], seed,
                               err, len(err))
    else:
        rc = lib().mbmlx_qmv(p["kernel"].encode(), int(p["kind"] == "qmv_wide"), M, N, K, grid,
                             group, ptr(wq), ptr(scales), ptr(biases), ptr(x), ptr(y),
                             E.ORDERS[order], seed, err, len(err))
    E._check(rc, err)
    return y


def reduce_record(M: int, N: int, split_k: int) -> dict:
    """The traffic of MLX's strided sum after split-K, which is not emulated:
    its analytic minimum (every float32 partial read once, y written once),
    as a record shaped like metal_emu.counting's."""
    w = dict.fromkeys(E.WIDTHS, 0)
    rd, wr = 4 * split_k * M * N, 2 * M * N
    return {"kernel": "mlx strided_reduce sum (analytic, not emulated)", "threads": 0,
            "grid": [0, 0, 0], "group": [0, 0, 0], "device_read_bytes": rd,
            "device_write_bytes": wr, "device_read_by_width": {**w, "4": rd},
            "device_write_by_width": {**w, "2": wr}, "threadgroup_read_bytes": 0,
            "threadgroup_write_bytes": 0, "barriers": 0, "simdgroup_barriers": 0, "mma": 0,
            "device_unique_read_bytes": rd, "device_unique_write_bytes": wr}


def counting():
    """metal_emu.counting on this library: one record per dispatch."""
    return E.counting(lib())
