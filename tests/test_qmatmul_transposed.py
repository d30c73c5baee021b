"""The CPU transposed product dx = dy · W (MixedQMatmulT), which the
gradient of mixbits.qmatmul wrt x runs on a CPU stream: every backend
against float64 numpy on MLX's own dequantize (tests/reference.py), and its
own derivatives against the same function built from mx.dequantize +
matmul, which MLX differentiates itself."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from mixbits import _ext
from mixbits._backends import BACKENDS as BACKEND_IDS
from mixbits.layout import BITS, GROUP_SIZES, QuantizedTensor, Segment
from reference import assert_matmul_close, dequantize_f64, to_f64

BACKENDS = mixbits.ops.available_backends()
M_VALUES = [1, 3, 17, 130, 300]
# W-row tiles: 128 (AVX-512 broadcast kernel) or 1024 padded to 16 (AVX2
# transposed tiles), 64-128 columns: N below and above one tile of either,
# none a multiple of 16.
N_VALUES = [1, 37, 1100]


def rand(rng, shape, dtype=mx.float32):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def make(rng, n, specs, dtype=mx.float32, perm=True):
    k = sum(s[2] for s in specs)
    p = rng.permutation(k) if perm else None
    return mixbits.quantize(rand(rng, (n, k), dtype), specs, perm=p, dtype=dtype)


def dx_through_vjp(qt, dy, backend=None, x=None):
    """dx of mixbits.qmatmul's vjp (the primal x does not enter dx)."""
    if x is None:
        x = mx.zeros(dy.shape[:-1] + (qt.shape[1],), dy.dtype)
    _, (dx,) = mx.vjp(lambda v: mixbits.qmatmul(v, qt, backend=backend), [x], [dy])
    return dx


def unpermute(qt, w):
    if qt.perm is None:
        return w
    wu = np.zeros_like(w)
    wu[:, np.asarray(qt.perm)] = w  # column perm[k] of x meets stored column k
    return wu


def reference(qt, dy):
    """(dy · W in original column order, error scale) in float64.

    The error scale is sum |dy| (|s| q + |b|), not sum |dy||w|: a kernel may
    round s*q + b once (FMA) where MLX rounds twice, a difference of an ulp
    of |s q| + |b| that is large next to a w that nearly cancels (b ~ -s q).
    """
    absq = QuantizedTensor([Segment(s.bits, s.group_size, s.k, s.wq, mx.abs(s.scales),
                                    mx.abs(s.biases)) for s in qt.segments], qt.perm)
    d = to_f64(dy)
    return (d @ unpermute(qt, dequantize_f64(qt)),
            np.abs(d) @ unpermute(qt, dequantize_f64(absq)))


ACC_RTOL = {mx.float32: 2e-5, mx.float16: 2e-5, mx.bfloat16: 2e-5}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits,group_size", list(itertools.product(BITS, GROUP_SIZES)))
def test_every_bits_and_group_size(bits, group_size, backend):
    rng = np.random.default_rng(bits * 131 + group_size)
    # Up to 4 of the AVX2 kernel's column items (64 or 128 wide) per segment.
    k = group_size * int(rng.integers(1, 5))
    for n, m in zip(itertools.cycle(N_VALUES), M_VALUES):
        qt = make(rng, n, [(bits, group_size, k)], perm=False)
        dy = rand(rng, (m, n))
        ref, mag = reference(qt, dy)
        assert_matmul_close(dx_through_vjp(qt, dy, backend), ref, mag)


MIXED = [
    [(4, 64, 128), (3, 32, 96), (2, 128, 256)],
    [(8, 32, 32), (6, 64, 192), (5, 128, 128)],
    [(3, 128, 384), (2, 32, 32), (4, 32, 64)],
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("specs", MIXED, ids=["4-3-2", "8-6-5", "3-2-4"])
def test_mixed_segments_with_permutation(specs, backend):
    rng = np.random.default_rng(sum(s[2] for s in specs))
    for n in N_VALUES:
        qt = make(rng, n, specs, perm=True)
        for m in M_VALUES:
            dy = rand(rng, (m, n))
            ref, mag = reference(qt, dy)
            assert_matmul_close(dx_through_vjp(qt, dy, backend), ref, mag)


@pytest.mark.skipif("avx2" not in BACKENDS, reason="no AVX2 on this CPU")
def test_eight_lane_micro_kernel():
    """backend="avx2" runs the 8-lane transposed tiles with the 4x3
    micro-kernel even on an AVX-512 CPU (where "avx512" and auto run the
    16-lane broadcast kernel), so both are checked here."""
    rng = np.random.default_rng(8)
    for specs in MIXED:
        qt = make(rng, 1100, specs, perm=True)
        for m in (1, 5, 130):
            dy = rand(rng, (m, 1100))
            ref, mag = reference(qt, dy)
            assert_matmul_close(dx_through_vjp(qt, dy, "avx2"), ref, mag)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("sdtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
def test_dtypes_and_leading_dims(dtype, sdtype, backend):
    """dy (= x's dtype) and scales in every float dtype, any leading dims,
    a strided dy; dx comes back in x's dtype."""
    rng = np.random.default_rng(7)
    qt = make(rng, 45, [(4, 64, 128), (3, 32, 64)], dtype=sdtype)
    dy = rand(rng, (2, 3, 45), dtype)
    dx = dx_through_vjp(qt, dy, backend)
    assert dx.dtype == dtype and dx.shape == (2, 3, 192)
    ref, mag = reference(qt, dy)
    assert_matmul_close(dx, ref, mag, ACC_RTOL[dtype])
    dyt = mx.swapaxes(rand(rng, (45, 5), dtype), 0, 1)  # a transposed view
    ref, mag = reference(qt, dyt)
    assert_matmul_close(dx_through_vjp(qt, dyt, backend), ref, mag, ACC_RTOL[dtype])


def test_backends_agree_and_threads_do_not_change_bits():
    """Every dx element has one writer and a fixed summation order, so the
    thread count changes nothing, bit for bit."""
    rng = np.random.default_rng(9)
    qt = make(rng, 1100, MIXED[0], perm=True)
    dy = rand(rng, (130, 1100))
    for b in BACKENDS:
        many = np.array(dx_through_vjp(qt, dy, b))
        prev = _ext.max_threads()
        _ext.set_max_threads(1)
        try:
            one = np.array(dx_through_vjp(qt, dy, b))
        finally:
            _ext.set_max_threads(prev)
        np.testing.assert_array_equal(many, one)


def test_non_finite_dy_like_a_dense_matmul():
    """No folded bias in the transposed kernels: inf and NaN in dy give what
    float64 dy @ W gives (inf*0 and inf-inf are NaN, else +-inf)."""
    rng = np.random.default_rng(10)
    qt = make(rng, 40, [(2, 32, 64)], perm=True)
    d = rng.standard_normal((4, 40)).astype(np.float32)
    d[0, 3], d[1, 5], d[1, 9], d[2, 7] = np.inf, np.inf, -np.inf, np.nan
    dy = mx.array(d)
    with np.errstate(invalid="ignore"):
        ref, _ = reference(qt, dy)
    for b in BACKENDS:
        got = to_f64(dx_through_vjp(qt, dy, b))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
        fin = np.isfinite(ref)
        np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-5, atol=1e-5)


def graph_text(tmp_path, a):
    path = tmp_path / "g.dot"
    mx.export_to_dot(str(path), a)
    return path.read_text()


def test_cpu_vjp_takes_the_transposed_kernel(tmp_path):
    """The vjp wrt x builds MixedQMatmulT on the CPU for a forced backend,
    and for auto where the transposed kernel is SIMD (x86 with AVX2)."""
    rng = np.random.default_rng(11)
    qt = make(rng, 20, [(4, 32, 64)])
    dy = rand(rng, (3, 20))
    for b in BACKENDS:
        assert "MixedQMatmulT" in graph_text(tmp_path, dx_through_vjp(qt, dy, b))
    auto = graph_text(tmp_path, dx_through_vjp(qt, dy))
    assert ("MixedQMatmulT" in auto) == ("avx2" in BACKENDS)


# ------------------------------------------------ derivatives of the vjp


def dx_functions(qt, x):
    """dx(dy, s0, b0, ...) through mixbits and through mx.dequantize."""
    segs, perm = qt.segments, qt.perm

    def ours(v, *sb):
        t = QuantizedTensor([Segment(s.bits, s.group_size, s.k, s.wq, sb[2 * i], sb[2 * i + 1])
                             for i, s in enumerate(segs)], perm)
        return mixbits.qmatmul(v, t)

    def ref(v, *sb):
        W = mx.concatenate(
            [mx.dequantize(s.wq, sb[2 * i], sb[2 * i + 1], group_size=s.group_size, bits=s.bits)
             for i, s in enumerate(segs)], axis=-1)
        # x[..., perm] as a product with a one-hot matrix: MLX has no jvp
        # for the scatter that take's vjp is.
        return (v @ P) @ W.T

    k = qt.shape[1]
    P = mx.array(np.eye(k, dtype=np.float32)[:, np.asarray(perm)])

    def dx(fn):
        return lambda dy, *sb: mx.vjp(lambda v: fn(v, *sb), [x], [dy])[1][0]

    return dx(ours), dx(ref), [a for s in segs for a in (s.scales, s.biases)]


def test_second_order_vjp_jvp_vmap():
    """Gradients of the gradient (wrt dy, scales, biases), jvp and vmap of
    MixedQMatmulT against MLX differentiating dequantize + matmul."""
    rng = np.random.default_rng(12)
    qt = make(rng, 21, [(4, 64, 128), (3, 32, 64)], perm=True)
    x = rand(rng, (5, 192))
    ours, ref, sb = dx_functions(qt, x)
    primals = [rand(rng, (5, 21)), *sb]
    ct = rand(rng, (5, 192))
    (o1,), g_o = mx.vjp(ours, primals, [ct])
    (r1,), g_r = mx.vjp(ref, primals, [ct])
    np.testing.assert_allclose(np.array(o1), np.array(r1), rtol=1e-4, atol=1e-4)
    for a, b in zip(g_o, g_r):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)
    tangents = [rand(rng, p.shape) for p in primals]
    (_,), (t_o,) = mx.jvp(ours, primals, tangents)
    (_,), (t_r,) = mx.jvp(ref, primals, tangents)
    np.testing.assert_allclose(np.array(t_o), np.array(t_r), rtol=1e-4, atol=1e-4)
    dys = rand(rng, (4, 5, 21))
    v_o = mx.vmap(lambda d: ours(d, *sb), in_axes=1)(mx.swapaxes(dys, 0, 1))
    v_r = mx.stack([ref(d, *sb) for d in dys])
    np.testing.assert_allclose(np.array(v_o), np.array(v_r), rtol=1e-4, atol=1e-4)


def test_repeated_permutation_entries_accumulate():
    """The C++ op takes any in-range index vector (the Python layer refuses
    non-permutations): dx is then the transpose of the gather, repeated
    columns summed, as MLX's own take + matmul differentiates."""
    rng = np.random.default_rng(13)
    qt = make(rng, 30, [(4, 32, 64), (3, 32, 32)], perm=False)
    idx = rng.integers(0, 96, 96).astype(np.int32)  # repeats, and gaps
    perm = mx.array(idx)
    W = mx.concatenate([mx.dequantize(s.wq, s.scales, s.biases, group_size=s.group_size,
                                      bits=s.bits) for s in qt.segments], axis=-1)
    x, dy = rand(rng, (7, 96)), rand(rng, (7, 30))
    _, (want,) = mx.vjp(lambda v: mx.take(v, perm, axis=-1) @ W.T, [x], [dy])
    for b in BACKENDS:
        f = lambda v: _ext.qmatmul(v, perm, qt.arrays(), qt.specs, BACKEND_IDS[b])
        _, (got,) = mx.vjp(f, [x], [dy])
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    # An out-of-range index: NaN, as the forward gives, never garbage.
    bad = mx.array(np.where(np.arange(96) == 5, 96, idx).astype(np.int32))
    for b in BACKENDS:
        f = lambda v: _ext.qmatmul(v, bad, qt.arrays(), qt.specs, BACKEND_IDS[b])
        _, (got,) = mx.vjp(f, [x], [dy])
        assert np.isnan(np.array(got)).all()
