"""The gradient of mixbits.gather_qmatmul wrt x on the CPU: the transposed
kernel through the packed expert stack (MixedGatherQMMT), for every
backend, against float64 numpy on MLX's own dequantize (dx[lhs[i]] +=
dy[i] @ W[rhs[i]], un-permuted); bad indices; thread-count independence;
and its own derivatives against mx.dequantize + mx.gather_mm, which MLX
differentiates itself."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from mixbits import _ext
from mixbits.layout import BITS, GROUP_SIZES, QuantizedTensor, Segment
from reference import assert_matmul_close, to_f64

BACKENDS = mixbits.ops.available_backends()
DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def rand(rng, shape, dtype=mx.float32):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def stack(rng, E, n, specs, dtype=mx.float32, perm=True):
    """Expert stack (E, n, ·) of one mixed layout, quantized by mixbits."""
    k = sum(s[2] for s in specs)
    qt = mixbits.quantize(rand(rng, (E * n, k), dtype), specs,
                          perm=rng.permutation(k) if perm else None, dtype=dtype)
    segs = [Segment(s.bits, s.group_size, s.k, *(a.reshape(E, n, -1) for a in (s.wq, s.scales, s.biases)))
            for s in qt.segments]
    return QuantizedTensor(segs, qt.perm)


def dense_f64(qt, absolute=False):
    """(E..., N, K) float64 in x's column order through mx.dequantize; with
    absolute=True, |s| q + |b| (the error scale: a kernel may round s*q + b
    once where MLX rounds twice)."""
    parts = []
    for s in qt.segments:
        sc, b = s.scales.astype(mx.float32), s.biases.astype(mx.float32)
        if absolute:
            sc, b = mx.abs(sc), mx.abs(b)
        parts.append(to_f64(mx.dequantize(s.wq, sc, b, group_size=s.group_size, bits=s.bits)))
    W = np.concatenate(parts, axis=-1)
    if qt.perm is None:
        return W
    Wu = np.zeros_like(W)
    Wu[..., np.asarray(qt.perm)] = W  # x's column perm[k] meets stored column k
    return Wu


def reference(qt, x_shape, dy, lhs, rhs):
    """(dx, error scale) in float64: dx[lhs[i]] += dy[i] @ W[rhs[i]]."""
    M, K = x_shape[-2:]
    W, A = dense_f64(qt), dense_f64(qt, absolute=True)
    W, A = W.reshape(-1, *W.shape[-2:]), A.reshape(-1, *A.shape[-2:])
    d = to_f64(dy).reshape(-1, M, dy.shape[-1])
    dx, mag = np.zeros((int(np.prod(x_shape[:-2])), M, K)), np.zeros((int(np.prod(x_shape[:-2])), M, K))
    for i, (l, r) in enumerate(zip(np.ravel(lhs), np.ravel(rhs))):
        dx[l] += d[i] @ W[r]
        mag[l] += np.abs(d[i]) @ A[r]
    return dx.reshape(x_shape), mag.reshape(x_shape)


def indices(lhs, rhs, x_batch, w_batch):
    """The defaults gather_qmm gives a missing index, broadcast together."""
    lhs = np.arange(int(np.prod(x_batch))).reshape(x_batch) if lhs is None else lhs
    rhs = np.arange(int(np.prod(w_batch))).reshape(w_batch) if rhs is None else rhs
    return np.broadcast_arrays(lhs, rhs)


def dx_of(qt, x, lhs, rhs, dy, backend=None, sorted_indices=False):
    li = None if lhs is None else mx.array(lhs)
    ri = None if rhs is None else mx.array(rhs)
    f = lambda v: mixbits.gather_qmatmul(v, qt, li, ri, sorted_indices, backend=backend)
    _, (dx,) = mx.vjp(f, [x], [dy])
    return dx


def check(qt, x_shape, lhs, rhs, backend, dtype=mx.float32, seed=0, sorted_indices=False, acc_rtol=2e-5):
    rng = np.random.default_rng(seed)
    L, R = indices(lhs, rhs, x_shape[:-2], qt.segments[0].wq.shape[:-2])
    x = rand(rng, x_shape, dtype)
    dy = rand(rng, (*L.shape, x_shape[-2], qt.segments[0].wq.shape[-2]), dtype)
    dx = dx_of(qt, x, lhs, rhs, dy, backend, sorted_indices)
    assert dx.dtype == dtype and dx.shape == x.shape
    ref, mag = reference(qt, x_shape, dy, L, R)
    assert_matmul_close(dx, ref, mag, acc_rtol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits,group_size", list(itertools.product(BITS, GROUP_SIZES)))
def test_every_bits_and_group_size(bits, group_size, backend):
    """MoE routing (x tokens, top-2 experts, M = 1) and a gather with
    repeated lhs entries (several pairs accumulate into one x matrix)."""
    rng = np.random.default_rng(bits * 131 + group_size)
    E, n = 4, int(rng.integers(1, 40))
    k = group_size * int(rng.integers(1, 4))
    qt = stack(rng, E, n, [(bits, group_size, k)], perm=False)
    check(qt, (6, 1, 1, k), None, rng.integers(0, E, (6, 2)), backend, seed=bits)
    check(qt, (3, 5, k), np.array([2, 0, 2, 2, 1, 0]), rng.integers(0, E, 6), backend, seed=group_size)


MIXED = [
    [(4, 64, 128), (3, 32, 96), (2, 128, 256)],
    [(8, 32, 32), (6, 64, 192), (5, 128, 128)],
    [("ternary", 64, 128), (2, 32, 32), (4, 32, 64)],
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("specs", MIXED, ids=["4-3-2", "8-6-5", "t-2-4"])
def test_mixed_segments_with_permutation(specs, backend):
    """N across one kernel tile (128 / 1024 rows) and not a multiple of 16;
    several rows per pair; an expert no pair chose; an x matrix no pair
    reads (its dx is zero)."""
    rng = np.random.default_rng(sum(s[2] for s in specs))
    for n in (37, 1100):
        qt = stack(rng, 3, n, specs)
        k = qt.shape[1]
        check(qt, (5, 3, k), np.array([0, 3, 3, 1, 0, 3, 4]), np.array([2, 0, 2, 2, 0, 0, 2]), backend, seed=n)
        check(qt, (4, 1, 1, k), None, rng.integers(0, 3, (4, 2)), backend, seed=n + 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sorted_indices", [False, True])
def test_dtypes_sorted_and_leading_dims(dtype, sorted_indices, backend):
    """x in every float dtype (scales in the same), dx back in x's dtype;
    mlx-lm's sorted form (x gathered to (P, 1, K), rhs sorted) and batch
    shapes with several leading dims."""
    rng = np.random.default_rng(3)
    qt = stack(rng, 5, 45, [(4, 64, 128), (3, 32, 64)], dtype)
    rhs = np.sort(rng.integers(0, 5, 16)).astype(np.uint32)
    check(qt, (16, 1, 192), None, rhs, backend, dtype, seed=1, sorted_indices=sorted_indices)
    lhs = rng.integers(0, 6, (4, 2))
    check(qt, (2, 3, 2, 192), lhs, rng.integers(0, 5, (4, 2)), backend, dtype, seed=2,
          sorted_indices=sorted_indices)
    # Weights with leading dims (2, 3) indexed flat, rhs defaulting to all 6.
    qt6 = QuantizedTensor([Segment(s.bits, s.group_size, s.k,
                                   *(mx.concatenate([a, a[:1]]).reshape(2, 3, *a.shape[1:])
                                     for a in (s.wq, s.scales, s.biases))) for s in qt.segments], qt.perm)
    check(qt6, (6, 2, 192), rng.integers(0, 6, (2, 3)), None, backend, dtype, seed=3)


def test_many_rows_per_expert_split_over_calls():
    """More rows than one kernel call takes (2048): every chunk lands in
    its own dx rows."""
    rng = np.random.default_rng(4)
    qt = stack(rng, 2, 20, [(4, 32, 64)], perm=True)
    rhs = np.r_[np.zeros(2100), np.ones(30)].astype(np.uint32)
    for b in BACKENDS:
        check(qt, (2130, 1, 64), None, rhs, b)
        check(qt, (3, 700, 64), np.array([0, 1, 2, 0]), np.array([0, 0, 0, 1]), b)


def test_backends_agree_and_threads_do_not_change_bits():
    """Pairs sharing an lhs accumulate in a fixed order, each dx element
    written by one thread: the thread count changes nothing, bit for bit."""
    rng = np.random.default_rng(5)
    qt = stack(rng, 4, 300, MIXED[0])
    x = rand(rng, (6, 3, 480))
    lhs, rhs = rng.integers(0, 6, 40), rng.integers(0, 4, 40)
    dy = rand(rng, (40, 3, 300))
    for b in BACKENDS:
        many = np.array(dx_of(qt, x, lhs, rhs, dy, b))
        prev = _ext.max_threads()
        _ext.set_max_threads(1)
        try:
            one = np.array(dx_of(qt, x, lhs, rhs, dy, b))
        finally:
            _ext.set_max_threads(prev)
        np.testing.assert_array_equal(many, one)


def test_out_of_range_indices_give_nan_dx():
    """As the forward's NaN rows: an index the stack or x does not have
    makes dx NaN (never a read out of bounds, never a silently dropped pair)."""
    rng = np.random.default_rng(6)
    qt = stack(rng, 3, 8, [(4, 32, 64)])
    x = rand(rng, (4, 2, 64))
    for lhs, rhs in [(None, [0, 3, 2, 1]), (None, mx.array([0, -1, 2, 1], dtype=mx.int32)),
                     ([0, 9, 2], [0, 1, 2])]:
        n = 4 if lhs is None else 3
        dy = rand(rng, (n, 2, 8))
        for b in BACKENDS:
            dx = np.array(dx_of(qt, x, lhs, rhs if isinstance(rhs, mx.array) else np.array(rhs), dy, b))
            assert np.isnan(dx).all()


def graph_text(tmp_path, a):
    path = tmp_path / "g.dot"
    mx.export_to_dot(str(path), a)
    return path.read_text()


def test_cpu_vjp_takes_the_transposed_kernel(tmp_path):
    """The vjp wrt x builds MixedGatherQMMT for a forced backend, and for
    auto where the transposed kernel is SIMD (MixedQMatmul's rule); the
    dense gather_mm path is gone from such a graph."""
    rng = np.random.default_rng(7)
    qt = stack(rng, 3, 20, [(4, 32, 64)])
    x, dy = rand(rng, (4, 1, 1, 64)), rand(rng, (4, 2, 1, 20))
    rhs = rng.integers(0, 3, (4, 2))
    for b in BACKENDS:
        g = graph_text(tmp_path, dx_of(qt, x, None, rhs, dy, b))
        assert "MixedGatherQMMT" in g and "GatherMM" not in g
    auto = graph_text(tmp_path, dx_of(qt, x, None, rhs, dy))
    assert ("MixedGatherQMMT" in auto) == ("avx2" in BACKENDS)


# ------------------------------------------------ derivatives of the vjp


def test_second_order_vjp_and_jvp():
    """Gradients of dx wrt dy, scales and biases, and its jvp, against the
    same dx built from mx.dequantize + gather_mm (MLX differentiates it),
    as they were when dx itself was built from those ops."""
    rng = np.random.default_rng(8)
    qt = stack(rng, 3, 9, [(4, 64, 64), (3, 32, 64)])
    x = rand(rng, (4, 2, 128))
    lhs, rhs = mx.array([3, 0, 0, 2, 1]), mx.array([2, 2, 0, 1, 0])
    P = mx.array(np.eye(128, dtype=np.float32)[:, np.asarray(qt.perm)])

    def ours(v, *sb):
        t = QuantizedTensor([Segment(s.bits, s.group_size, s.k, s.wq, sb[2 * i], sb[2 * i + 1])
                             for i, s in enumerate(qt.segments)], qt.perm)
        return mixbits.gather_qmatmul(v, t, lhs, rhs)

    def ref(v, *sb):
        W = mx.concatenate([mx.dequantize(s.wq, sb[2 * i], sb[2 * i + 1], group_size=s.group_size,
                                          bits=s.bits) for i, s in enumerate(qt.segments)], axis=-1)
        # x[..., perm] as a product with a one-hot matrix: MLX has no jvp
        # for the scatter that take's vjp is.
        return mx.gather_mm(v @ P, mx.swapaxes(W, -1, -2), lhs, rhs)

    def dx(fn):
        return lambda dy, *sb: mx.vjp(lambda v: fn(v, *sb), [x], [dy])[1][0]

    sb = [a for s in qt.segments for a in (s.scales, s.biases)]
    primals = [rand(rng, (5, 2, 9)), *sb]
    ct = rand(rng, x.shape)
    (o,), g_o = mx.vjp(dx(ours), primals, [ct])
    (r,), g_r = mx.vjp(dx(ref), primals, [ct])
    np.testing.assert_allclose(np.array(o), np.array(r), rtol=1e-4, atol=1e-4)
    for a, b in zip(g_o, g_r):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)
    # jvp: MLX has none for GatherMM, so the adjoint identity instead,
    # <jvp(t), ct> = <t, vjp(ct)>, on the reference's vjp.
    tangents = [rand(rng, p.shape) for p in primals]
    (_,), (t_o,) = mx.jvp(dx(ours), primals, tangents)
    lhs_ = float((to_f64(t_o) * to_f64(ct)).sum())
    rhs_ = sum(float((to_f64(t) * to_f64(g)).sum()) for t, g in zip(tangents, g_r))
    assert abs(lhs_ - rhs_) <= 1e-4 * max(abs(rhs_), 1.0)
