"""Every CPU backend of qmatmul (forced with backend=...) against the scalar
reference backend and against MLX's dequantize + float64 numpy, on
randomized shapes that hit each regime of the SIMD kernels: batch-1,
decode-once small M, the dequantized-tile GEMM path, tails of every
blocking, tiny segments, mixed segments with a permutation."""

import itertools
import threading

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from mixbits import _ext, ops
from mixbits.layout import BITS, GROUP_SIZES
from reference import assert_matmul_close, qmatmul_f64

# "avx2" runs the 8-lane kernels even on an AVX-512 CPU, "avx512" the
# 16-lane ones: both are checked wherever the CPU has them.
SIMD = [b for b in ops.available_backends() if b not in ("auto", "ref")]
DTYPES = [mx.float32, mx.float16, mx.bfloat16]
# 1: batch-1; 2..8: decode once for all rows; 9: 8+1 rows; 17, 130: the
# dequantized-tile path (130 also leaves an M tail in its 4-row blocks).
MS = [1, 2, 3, 5, 8, 9, 17, 130]

pytestmark = pytest.mark.skipif(not SIMD, reason="no SIMD backend on this CPU")


def rand(rng, shape, dtype=mx.float32):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def check_backend(backend, x, qt):
    y = mixbits.qmatmul(x, qt, backend=backend)
    y_ref = mixbits.qmatmul(x, qt, backend="ref")
    ref64, mag = qmatmul_f64(x, qt)
    assert y.dtype == x.dtype and y.shape == y_ref.shape
    assert_matmul_close(y, ref64, mag)      # independent reference
    assert_matmul_close(y, np.array(y_ref.astype(mx.float32), dtype=np.float64), mag)


def test_simd_backend_available_on_x86_avx2():
    # The CPU this project is developed on has AVX2; if it was not picked up
    # the fast path silently vanished.
    import platform

    if platform.machine() in ("x86_64", "AMD64"):
        flags = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
        if " avx2 " in flags and " fma " in flags and " f16c " in flags:
            assert "avx2" in SIMD


@pytest.mark.parametrize("backend", SIMD)
@pytest.mark.parametrize("bits,group_size", list(itertools.product(BITS, GROUP_SIZES)))
def test_all_bits_groups_all_m(backend, bits, group_size):
    rng = np.random.default_rng(bits * 1000 + group_size)
    # N not a multiple of any blocking (4 rows, 3 rows, 48-row tiles, 8 lanes).
    n = int(rng.choice([1, 5, 13, 50, 101]))
    k = group_size * int(rng.integers(1, 5))
    qt = mixbits.quantize(rand(rng, (n, k)), [(bits, group_size, k)],
                          dtype=DTYPES[(bits + group_size) % 3])
    for m in MS:
        check_backend(backend, rand(rng, (m, k)), qt)


@pytest.mark.parametrize("backend", SIMD)
@pytest.mark.parametrize("scale_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("x_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 5, 17])
def test_scale_and_x_dtypes(backend, scale_dtype, x_dtype, m):
    rng = np.random.default_rng(m)
    # 9 groups of 64 for the f16/bf16 8-at-a-time scale conversion + tail.
    qt = mixbits.quantize(rand(rng, (23, 576)), [(4, 64, 576)], dtype=scale_dtype)
    check_backend(backend, rand(rng, (m, 576), x_dtype), qt)


@pytest.mark.parametrize("backend", SIMD)
@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_segments_with_perm(backend, seed):
    rng = np.random.default_rng(100 + seed)
    nseg = int(rng.integers(2, 6))
    specs = []
    for _ in range(nseg):
        gs = int(rng.choice(GROUP_SIZES))
        # Tiny segments (one 32-column group) as well as ones longer than a
        # 512-column GEMM tile.
        specs.append((int(rng.choice(BITS)), gs, gs * int(rng.choice([1, 2, 5, 9]))))
    if seed == 0:
        specs = [(8, 32, 32), (2, 32, 32), (3, 32, 32), (5, 32, 32), (6, 32, 32)]
    k = sum(s[2] for s in specs)
    n = int(rng.integers(1, 70))
    qt = mixbits.quantize(rand(rng, (n, k)), specs, perm=rng.permutation(k),
                          dtype=DTYPES[seed % 3])
    for m in MS:
        shape = (m, k) if seed % 2 else (2, (m + 1) // 2, k)  # leading dims too
        check_backend(backend, rand(rng, shape), qt)


@pytest.mark.parametrize("backend", SIMD)
def test_large_values_and_ternary(backend):
    # Activations of very different sizes (the kernels pre-scale x by powers
    # of two) and a ternary segment (codes 0..2 of a 2-bit field).
    rng = np.random.default_rng(5)
    w = rand(rng, (33, 384))
    qt = mixbits.quantize(w, [("ternary", 64, 128), (6, 128, 256)])
    x = np.array(rand(rng, (9, 384)))
    x[:, ::7] *= 1e4
    x[:, 3::11] *= 1e-4
    for m in (1, 4, 9):
        check_backend(backend, mx.array(x[:m]), qt)
    check_backend(backend, mx.array(np.tile(x, (3, 1))), qt)


@pytest.mark.parametrize("backend", SIMD)
def test_gemm_micro_kernels(backend):
    # The large-M path: a 6x4 micro-kernel ("avx512") or a 4x3 one ("avx2")
    # over 1024-column tiles; M and N leave tails in every block.
    rng = np.random.default_rng(11)
    k = 1024 + 192  # more than one 1024-column tile
    qt = mixbits.quantize(rand(rng, (103, k)), [(5, 32, 1024), (8, 64, 192)],
                          dtype=mx.float16)
    for m in (17, 23, 45):
        check_backend(backend, rand(rng, (m, k)), qt)


@pytest.mark.parametrize("backend", SIMD)
@pytest.mark.parametrize("m", [1, 2, 3, 6, 40])
def test_threaded_matches_single_thread(backend, m):
    if _ext.num_threads() < 2:
        pytest.skip("one worker thread on this machine")
    rng = np.random.default_rng(m)
    # 301 rows: slices of any size leave row-block tails somewhere.
    qt = mixbits.quantize(rand(rng, (301, 640)), [(4, 64, 128), (3, 32, 512)],
                          perm=rng.permutation(640))
    x = rand(rng, (m, 640))
    before = _ext.max_threads()
    try:
        _ext.set_max_threads(1)
        assert _ext.max_threads() == 1
        y1 = np.array(mixbits.qmatmul(x, qt, backend=backend))
    finally:
        _ext.set_max_threads(0)
    assert _ext.max_threads() == before
    yn = np.array(mixbits.qmatmul(x, qt, backend=backend))
    # Each output is computed by exactly one thread in the same order.
    np.testing.assert_array_equal(yn, y1)


@pytest.mark.parametrize("backend", SIMD)
def test_concurrent_callers(backend):
    # Several Python threads calling at once: the pool runs one job at a
    # time and the others run inline; every result must still be right.
    rng = np.random.default_rng(3)
    qt = mixbits.quantize(rand(rng, (200, 256)), [(4, 64, 256)])
    xs = [rand(rng, (m, 256)) for m in (1, 3, 20, 1)]
    want = [np.array(mixbits.qmatmul(x, qt, backend="ref")) for x in xs]
    got = [None] * len(xs)
    errors = []

    def work(i):
        try:
            s = mx.new_stream(mx.cpu)
            with mx.stream(s):
                for _ in range(5):
                    got[i] = np.array(mixbits.qmatmul(xs[i], qt, backend=backend))
        except Exception as e:  # surfaced below, not swallowed
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for g, w_ in zip(got, want):
        np.testing.assert_allclose(g, w_, rtol=1e-4, atol=1e-4)


def test_forcing_an_unavailable_backend_is_a_clear_error():
    missing = [b for b in ("avx2", "avx512", "neon") if b not in ops.available_backends()]
    qt = mixbits.quantize(mx.ones((4, 64)), [(4, 64, 64)])
    for b in missing:
        with pytest.raises(ValueError, match="backend"):
            mixbits.qmatmul(mx.ones((1, 64)), qt, backend=b)
    with pytest.raises(ValueError, match="backend"):
        mixbits.qmatmul(mx.ones((1, 64)), qt, backend="sse9")
