"""The Mac-only host sources (cpp/*/metal.cpp, eval_gpu) cannot be built on
Linux, but they can be type-checked: g++ -fsyntax-only with _METAL_ defined,
against the real MLX Metal-backend headers installed with mlx, with
tests/metal/stub/Metal/Metal.hpp standing in for Apple's metal-cpp. This
catches wrong MLX API names and signatures, wrong includes, and drift from
the params/host headers; it cannot check the Metal API calls themselves."""

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core
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
    assert {p.parent.name for p in HOST_SOURCES} >= {"qmatmul", "kl", "gather", "fpmatmul"}


def test_eval_gpu_sources_typecheck_against_mlx_headers():
    cxx = E.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    inc = mlx_include()

    def check(src: Path):
        cmd = [cxx, "-std=c++20", "-fsyntax-only", "-D_METAL_", "-DMIXBITS_HAS_METALLIB=1",
               "-Wall", "-Werror",
               f"-I{E.EMU_DIR / 'stub'}", f"-I{inc}", f"-I{E.ROOT / 'cpp'}",
               f"-I{E.METAL_DIR}", str(src)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        return src, r.returncode, r.stderr

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(check, HOST_SOURCES))
    failed = [f"{src}:\n{err[-4000:]}" for src, rc, err in results if rc != 0]
    assert not failed, "\n".join(failed)


# ------------------------------------------------ quant_utils.h as plain C++

@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    import ctypes

    cxx = E.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("plain") / "libqu.so"
    r = subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Werror",
                        f"-I{E.METAL_DIR}", str(E.EMU_DIR / "plain_cpp_check.cpp"), "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    L = ctypes.CDLL(str(out))
    P = ctypes.c_void_p
    L.qu_unpack_row.argtypes = [P, ctypes.c_int, ctypes.c_int, P]
    L.qu_unpack_row_words.argtypes = [P, ctypes.c_int, ctypes.c_int, P]
    L.qu_qdot16.argtypes = [P, ctypes.c_int, P]
    L.qu_qdot16.restype = ctypes.c_float
    L.qu_f32_to_bf16.argtypes = [ctypes.c_float]
    L.qu_f32_to_bf16.restype = ctypes.c_uint16
    L.qu_bf16_to_f32.argtypes = [ctypes.c_uint16]
    L.qu_bf16_to_f32.restype = ctypes.c_float
    return L


def bitstream_codes(wq_row, bits):
    """Codes of one MLX row by definition: LSB-first bits of the uint32 words."""
    import numpy as np
    stream = np.unpackbits(np.ascontiguousarray(wq_row).view(np.uint8), bitorder="little")
    return stream.reshape(-1, bits) @ (1 << np.arange(bits))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_plain_cpp_decode_matches_mlx_layout(plain, bits):
    import ctypes

    import numpy as np
    rng = np.random.default_rng(bits)
    k = 128
    w = mlx.core.array(rng.standard_normal((3, k)).astype(np.float32))
    wq, s, b = mlx.core.quantize(w, group_size=32, bits=bits)
    deq = np.array(mlx.core.dequantize(wq, s, b, group_size=32, bits=bits))
    wq, s, b = np.array(wq), np.array(s), np.array(b)
    for n in range(3):
        row = np.ascontiguousarray(wq[n])
        codes = np.zeros(k, np.uint32)
        assert plain.qu_unpack_row(row.ctypes.data_as(ctypes.c_void_p), bits, k,
                                   codes.ctypes.data_as(ctypes.c_void_p)) == 0
        np.testing.assert_array_equal(codes, bitstream_codes(row, bits))
        # The tiled kernel's word decode (mb_unpack8_words) gives the same.
        codes_w = np.zeros(k, np.uint32)
        assert plain.qu_unpack_row_words(row.ctypes.data_as(ctypes.c_void_p), bits, k,
                                         codes_w.ctypes.data_as(ctypes.c_void_p)) == 0
        np.testing.assert_array_equal(codes_w, codes)
        # ... and those codes are what mx.dequantize decodes.
        np.testing.assert_allclose(codes * np.repeat(s[n], 32) + np.repeat(b[n], 32), deq[n],
                                   rtol=1e-6, atol=1e-6)
        x = rng.standard_normal(k).astype(np.float32)
        rb = row.view(np.uint8)
        for c0 in range(0, k, 16):
            got = plain.qu_qdot16(rb[c0 * bits // 8:].ctypes.data_as(ctypes.c_void_p), bits,
                                  x[c0:].ctypes.data_as(ctypes.c_void_p))
            want = float(codes[c0:c0 + 16].astype(np.float64) @ x[c0:c0 + 16])
            assert abs(got - want) <= 1e-5 * (1 + np.abs(x[c0:c0 + 16]).sum() * (1 << bits))


def test_plain_cpp_bf16_conversion_matches_mlx(plain):
    import numpy as np
    rng = np.random.default_rng(0)
    vals = np.concatenate([rng.standard_normal(200).astype(np.float32) * 1e3,
                           np.array([0.0, -0.0, np.inf, -np.inf, 1e38, 3e-39, 1.00390625,
                                     1.01171875], np.float32)])
    want = np.array(mlx.core.array(vals).astype(mlx.core.bfloat16).view(mlx.core.uint16))
    got = np.array([plain.qu_f32_to_bf16(float(v)) for v in vals], np.uint16)
    np.testing.assert_array_equal(got, want)
    back = np.array([plain.qu_bf16_to_f32(int(u)) for u in want], np.float32)
    np.testing.assert_array_equal(back, np.array(mlx.core.array(want).view(mlx.core.bfloat16)
                                                  .astype(mlx.core.float32)))
