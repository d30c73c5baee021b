"""mixbits.qmatmul / quantized_matmul against MLX's dequantize + float64
numpy matmul, on randomized shapes, dtypes, segments and permutations."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from mixbits.layout import BITS, GROUP_SIZES
from reference import assert_matmul_close, qmatmul_f64

X_DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def rand_w(rng, n, k, dtype=mx.float32):
    return mx.array(rng.standard_normal((n, k)).astype(np.float32)).astype(dtype)


def rand_x(rng, shape, dtype):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("bits,group_size", list(itertools.product(BITS, GROUP_SIZES)))
@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=str)
def test_single_segment_all_bits_groups_dtypes(bits, group_size, x_dtype):
    rng = np.random.default_rng(bits * 1000 + group_size)
    n = int(rng.integers(1, 40))
    k = group_size * int(rng.integers(1, 4))
    qt = mixbits.quantize(rand_w(rng, n, k, x_dtype), [(bits, group_size, k)])
    for m in (1, 2, 7):
        x = rand_x(rng, (m, k), x_dtype)
        y = mixbits.qmatmul(x, qt)
        assert y.dtype == x_dtype and y.shape == (m, n)
        ref, mag = qmatmul_f64(x, qt)
        assert_matmul_close(y, ref, mag)


@pytest.mark.parametrize("m", [1, 2, 7, 64, 300])
@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=str)
def test_rows_m(m, x_dtype):
    rng = np.random.default_rng(m)
    n, k = 37, 256
    qt = mixbits.quantize(rand_w(rng, n, k), [(4, 64, 128), (3, 32, 64), (2, 64, 64)],
                          perm=rng.permutation(k))
    x = rand_x(rng, (m, k), x_dtype)
    ref, mag = qmatmul_f64(x, qt)
    assert_matmul_close(mixbits.qmatmul(x, qt), ref, mag)


@pytest.mark.parametrize("scale_dtype", X_DTYPES, ids=str)
@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=str)
def test_scale_dtype_independent_of_x_dtype(scale_dtype, x_dtype):
    rng = np.random.default_rng(7)
    qt = mixbits.quantize(rand_w(rng, 19, 192), [(5, 64, 64), (6, 32, 128)], dtype=scale_dtype)
    assert qt.dtype == scale_dtype
    x = rand_x(rng, (3, 192), x_dtype)
    ref, mag = qmatmul_f64(x, qt)
    assert_matmul_close(mixbits.qmatmul(x, qt), ref, mag)


def random_segments(rng, k_units):
    """Random split of k_units*128 columns into segments of random bits/gs."""
    specs, left = [], k_units * 128
    while left:
        gs = int(rng.choice(GROUP_SIZES))
        k = min(left, gs * int(rng.integers(1, 5)))
        if left - k and (left - k) % 32:
            k = left
        gs = gs if k % gs == 0 else 32
        specs.append((int(rng.choice(BITS)), gs, k))
        left -= k
    return specs


@pytest.mark.parametrize("seed", range(12))
def test_random_mixed_segments_with_perm_and_3d_x(seed):
    rng = np.random.default_rng(100 + seed)
    k = 128 * int(rng.integers(1, 5))
    n = int(rng.integers(1, 70))
    specs = random_segments(rng, k // 128)
    perm = rng.permutation(k) if seed % 2 == 0 else None
    dtype = X_DTYPES[seed % 3]
    qt = mixbits.quantize(rand_w(rng, n, k), specs, perm=perm, dtype=dtype)
    x = rand_x(rng, (2, int(rng.integers(1, 6)), k), X_DTYPES[(seed // 3) % 3])
    y = mixbits.qmatmul(x, qt)
    assert y.shape == (*x.shape[:-1], n)
    ref, mag = qmatmul_f64(x, qt)
    assert_matmul_close(y, ref, mag)


def test_perm_means_x_gathered_and_approximates_original():
    rng = np.random.default_rng(3)
    n, k = 16, 256
    w = rand_w(rng, n, k)
    perm = rng.permutation(k)
    qt = mixbits.quantize(w, [(8, 32, k)], perm=perm)
    # The stored matrix is w[:, perm] ...
    stored = np.array(qt.dequantize())
    np.testing.assert_allclose(stored, np.array(w)[:, perm], atol=0.02)
    np.testing.assert_allclose(np.array(qt.dequantize(unpermute=True)), np.array(w), atol=0.02)
    # ... so y approximates x @ w.T in the original order.
    x = rand_x(rng, (4, k), mx.float32)
    y = np.array(mixbits.qmatmul(x, qt))
    want = np.array(x, dtype=np.float64) @ np.array(w, dtype=np.float64).T
    assert np.abs(y - want).max() < 0.05 * np.abs(want).max()


def test_non_contiguous_x():
    rng = np.random.default_rng(4)
    k, n = 128, 20
    qt = mixbits.quantize(rand_w(rng, n, k), [(4, 32, 64), (8, 64, 64)], perm=rng.permutation(k))
    base = rand_x(rng, (k, 6), mx.float32)
    for x in (base.T, rand_x(rng, (5, 2 * k), mx.float16)[:, ::2],
              mx.broadcast_to(rand_x(rng, (1, k), mx.float32), (3, k))):
        ref, mag = qmatmul_f64(x, qt)
        assert_matmul_close(mixbits.qmatmul(x, qt), ref, mag)


def test_strided_weights_and_perm():
    """The CPU graph adds no contiguous node for weights (eval_cpu reads a
    strided one through a copy): column-major views of every packed array
    and a strided perm give the same result as the dense ones."""
    from mixbits import _ext
    rng = np.random.default_rng(14)
    k, n = 128, 24
    qt = mixbits.quantize(rand_w(rng, n, k), [(4, 32, 64), (3, 64, 64)],
                          perm=rng.permutation(k))
    x = rand_x(rng, (3, k), mx.float32)
    want = np.array(mixbits.qmatmul(x, qt))
    packed = [mx.contiguous(a.T).T for a in qt.arrays()]  # same values, column-major
    perm = mx.stack([qt.perm, qt.perm], axis=1)[:, 0]     # stride 2
    mx.eval(*packed, perm)  # evaluated views
    got = _ext.qmatmul(x, perm, packed, qt.specs, 0, 0)
    np.testing.assert_array_equal(np.array(got), want)
    lazy = _ext.qmatmul(x, mx.stack([qt.perm, qt.perm], axis=1)[:, 1],
                        [mx.contiguous(a.T).T for a in qt.arrays()], qt.specs, 0, 0)
    np.testing.assert_array_equal(np.array(lazy), want)


def test_inside_mx_compile():
    rng = np.random.default_rng(5)
    qt = mixbits.quantize(rand_w(rng, 24, 128), [(3, 64, 128)])

    @mx.compile
    def f(x):
        return mx.tanh(mixbits.qmatmul(x * 2.0, qt)) + 1.0

    x = rand_x(rng, (3, 128), mx.float32)
    ref, mag = qmatmul_f64(x * 2.0, qt)
    got = np.array(f(x), dtype=np.float64)
    np.testing.assert_allclose(got, np.tanh(ref) + 1.0, atol=1e-4)


def test_matches_mx_quantized_matmul():
    rng = np.random.default_rng(6)
    for bits, gs in [(4, 64), (3, 32), (8, 128), (2, 64), (5, 32), (6, 128)]:
        w = rand_w(rng, 33, 256)
        wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
        x = rand_x(rng, (5, 256), mx.float32)
        want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=gs, bits=bits)
        got = mixbits.quantized_matmul(x, wq, s, b, group_size=gs, bits=bits)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


def test_flipping_one_weight_bit_changes_output():
    rng = np.random.default_rng(8)
    w = rand_w(rng, 8, 128)
    for bits in BITS:
        wq, s, b = mx.quantize(w, group_size=32, bits=bits)
        x = rand_x(rng, (1, 128), mx.float32)
        y0 = np.array(mixbits.quantized_matmul(x, wq, s, b, group_size=32, bits=bits))
        words = np.array(wq)
        row, word, bit = 5, int(rng.integers(words.shape[1])), int(rng.integers(32))
        words[row, word] ^= np.uint32(1 << bit)
        y1 = np.array(mixbits.quantized_matmul(x, mx.array(words), s, b, group_size=32, bits=bits))
        changed = np.nonzero(y0[0] != y1[0])[0]
        assert list(changed) == [row], (bits, changed)


def test_ternary_segment_values():
    rng = np.random.default_rng(9)
    w = rand_w(rng, 6, 128)
    qt = mixbits.quantize(w, [("ternary", 64, 128)])
    assert qt.specs == [(2, 64, 128)]
    d = np.array(qt.dequantize()).reshape(6, 2, 64)
    s = np.array(qt.segments[0].scales)
    for r in range(6):
        for g in range(2):
            vals = set(np.round(d[r, g] / s[r, g], 5))
            assert vals <= {-1.0, 0.0, 1.0}, vals
    x = rand_x(rng, (2, 128), mx.float32)
    ref, mag = qmatmul_f64(x, qt)
    assert_matmul_close(mixbits.qmatmul(x, qt), ref, mag)


def test_storage_accounting():
    w = mx.zeros((64, 512), dtype=mx.float16)
    qt = mixbits.quantize(w, [(4, 64, 256), (3, 32, 256)])
    # codes + fp16 scale and bias per group
    want_bits = 64 * (256 * 4 + 256 * 3) + 64 * (256 // 64 + 256 // 32) * 32
    assert qt.nbytes * 8 == want_bits
    assert qt.bits_per_weight == pytest.approx(want_bits / (64 * 512))
    assert mixbits.quantize(w, [(4, 64, 512)]).bits_per_weight == pytest.approx(4.5)


def test_empty_rows():
    rng = np.random.default_rng(10)
    qt = mixbits.quantize(rand_w(rng, 4, 64), [(4, 32, 64)])
    y = mixbits.qmatmul(mx.zeros((0, 64)), qt)
    assert y.shape == (0, 4)
