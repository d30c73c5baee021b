"""The Metal path on a real Apple GPU: mixbits on mx.gpu against the CPU
primitive and float64 references, and bad input refused before dispatch.

Needs a Mac with Metal (tests/metal/check_on_mac.sh runs it); on any other
machine the whole module is skipped, with one line saying so. On Linux the
same kernels are checked on the emulator (test_metal_kernels.py,
test_kl_vs_primitive.py, test_kl_accuracy.py).
"""

import mlx.core as mx
import numpy as np
import pytest

import mixbits
import mixbits.kl as mkl
from mixbits.layout import QuantizedTensor, Segment

if not (hasattr(mx, "metal") and mx.metal.is_available()):
    pytest.skip("needs an Apple GPU (Metal): run tests/metal/check_on_mac.sh on a Mac",
                allow_module_level=True)


def on(device, fn, *args, **kw):
    with mx.stream(device):
        out = fn(*args, **kw)
        mx.eval(out)
    return out


@pytest.mark.parametrize("M", [1, 3, 8, 9, 33, 200])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_quantized_matmul_gpu_matches_mlx(M, bits, dtype):
    rng = np.random.default_rng(M * 10 + bits)
    N, K, gs = 300, 512, 64
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32)).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(dtype)
    want = np.array(on(mx.cpu, mx.quantized_matmul, x, wq, s, b, transpose=True,
                       group_size=gs, bits=bits).astype(mx.float32))
    got = np.array(on(mx.gpu, mixbits.quantized_matmul, x, wq, s, b, group_size=gs,
                      bits=bits).astype(mx.float32))
    tol = {mx.float32: 2e-4, mx.float16: 2e-2, mx.bfloat16: 1e-1}[dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("M", [3, 100])
@pytest.mark.parametrize("xdt,sdt", [(mx.float32, mx.float16), (mx.bfloat16, mx.float32),
                                     (mx.float16, mx.bfloat16)])
def test_scale_dtype_other_than_x_gpu_matches_cpu(M, xdt, sdt):
    # Each (x dtype, scale dtype) pair is its own kernel instantiation.
    rng = np.random.default_rng(M)
    N, K, gs, bits = 77, 256, 32, 5
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32)).astype(sdt)
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(xdt)
    cpu = np.array(on(mx.cpu, mixbits.quantized_matmul, x, wq, s, b, group_size=gs,
                      bits=bits).astype(mx.float32))
    gpu = np.array(on(mx.gpu, mixbits.quantized_matmul, x, wq, s, b, group_size=gs,
                      bits=bits).astype(mx.float32))
    tol = {mx.float32: 1e-4, mx.float16: 2e-2, mx.bfloat16: 1e-1}[xdt]
    np.testing.assert_allclose(gpu, cpu, rtol=tol, atol=tol * np.abs(cpu).max())


@pytest.mark.parametrize("M", [1, 5, 40])
def test_mixed_segments_with_perm_gpu_matches_cpu(M):
    rng = np.random.default_rng(M)
    K, N = 640, 70
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
    perm = mx.array(rng.permutation(K).astype(np.int32))
    qt = mixbits.quantize(w, [(8, 128, 128), (5, 32, 96), (4, 64, 320), (2, 32, 96)],
                          perm=perm)
    x = mx.array(rng.standard_normal((2, M, K)).astype(np.float32))
    cpu = np.array(on(mx.cpu, mixbits.qmatmul, x, qt))
    gpu = np.array(on(mx.gpu, mixbits.qmatmul, x, qt))
    np.testing.assert_allclose(gpu, cpu, rtol=1e-4, atol=1e-4 * np.abs(cpu).max())
    # A strided x (a transpose) reaches the kernel contiguous.
    xt = mx.array(rng.standard_normal((K, M)).astype(np.float32)).T
    np.testing.assert_allclose(np.array(on(mx.gpu, mixbits.qmatmul, xt, qt)),
                               np.array(on(mx.cpu, mixbits.qmatmul, xt, qt)),
                               rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("M", [2, 12, 17])  # GEMV, 16-row and 32-row tiled blocks
@pytest.mark.parametrize("n_segs", [8, 11])
def test_many_segments_gpu_matches_cpu(M, n_segs):
    # One dispatch takes 8 segments (one segment table, every width); 11
    # need two dispatches passing a float32 partial sum.
    rng = np.random.default_rng(M + n_segs)
    specs = [((8, 6, 5, 4, 3, 2)[i % 6], (32, 64, 128)[i % 3], (32, 64, 128)[i % 3] * (1 + i % 2))
             for i in range(n_segs)]
    K, N = sum(k for _, _, k in specs), 45
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
    qt = mixbits.quantize(w, specs, perm=mx.array(rng.permutation(K).astype(np.int32)))
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(mx.float16)
    cpu = np.array(on(mx.cpu, mixbits.qmatmul, x, qt).astype(mx.float32))
    gpu = np.array(on(mx.gpu, mixbits.qmatmul, x, qt).astype(mx.float32))
    np.testing.assert_allclose(gpu, cpu, rtol=2e-2, atol=2e-2 * np.abs(cpu).max())


@pytest.mark.parametrize("n_segs", [3, 8, 11])
def test_gather_tiled_many_segments_gpu_matches_cpu(n_segs):
    # The tiled gathered kernel (sorted prefill, >= 8 rows per expert) walks
    # the segment table as the dense kernels do: 3 and 8 segments in one
    # dispatch, 11 in two passing a float32 partial sum; with a permutation.
    rng = np.random.default_rng(40 + n_segs)
    specs = [((8, 6, 5, 4, 3, 2)[i % 6], (32, 64, 128)[i % 3], (32, 64, 128)[i % 3] * (1 + i % 2))
             for i in range(n_segs)]
    K, E, n = sum(k for _, _, k in specs), 6, 45
    qt = mixbits.quantize(mx.array(rng.standard_normal((E * n, K)).astype(np.float32)), specs,
                          perm=mx.array(rng.permutation(K).astype(np.int32)))
    qt = QuantizedTensor([Segment(sg.bits, sg.group_size, sg.k,
                                  *(a.reshape(E, n, -1) for a in (sg.wq, sg.scales, sg.biases)))
                          for sg in qt.segments], qt.perm)
    ids = mx.array(np.sort(rng.integers(0, E, 100)).astype(np.uint32))
    x = mx.array(rng.standard_normal((100, 1, K)).astype(np.float32)).astype(mx.float16)
    cpu = np.array(on(mx.cpu, mixbits.gather_qmatmul, x, qt, None, ids,
                      sorted_indices=True).astype(mx.float32))
    gpu = np.array(on(mx.gpu, mixbits.gather_qmatmul, x, qt, None, ids,
                      sorted_indices=True).astype(mx.float32))
    np.testing.assert_allclose(gpu, cpu, rtol=2e-2, atol=2e-2 * np.abs(cpu).max())


def graph_ops(y, tmp_path):
    """The primitive names in y's graph (mx.export_to_dot labels)."""
    import re
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), y)
    return set(re.findall(r'label ="(\w+)"', path.read_text()))


@pytest.mark.parametrize("M", [1, 3, 12])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_gather_qmm_gpu_matches_mlx(M, bits, dtype):
    # Tokens x top-2 of 8 experts, unsorted with repeats, as SwitchGLU calls it.
    rng = np.random.default_rng(M * 10 + bits)
    E, N, K, gs = 8, 300, 512, 64
    w = mx.array(rng.standard_normal((E, N, K)).astype(np.float32)).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    x = mx.array(rng.standard_normal((16, 1, M, K)).astype(np.float32)).astype(dtype)
    rhs = mx.array(rng.integers(0, E, (16, 2)).astype(np.uint32))
    mx.eval(wq, s, b, x, rhs)
    want = np.array(on(mx.cpu, mx.gather_qmm, x, wq, s, b, None, rhs, transpose=True,
                       group_size=gs, bits=bits).astype(mx.float32))
    got = np.array(on(mx.gpu, mixbits.gather_quantized_matmul, x, wq, s, b, None, rhs,
                      group_size=gs, bits=bits).astype(mx.float32))
    tol = {mx.float32: 2e-4, mx.float16: 2e-2, mx.bfloat16: 1e-1}[dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("N", [2000, 4100])
def test_gemv_wide_threadgroups_gpu_matches_mlx(M, N):
    # N >= 1985 / 3969: the GEMV runs 16 / 32 simdgroups per threadgroup (up
    # to 1024 threads, bounded by the pipeline's maxTotalThreadsPerThreadgroup).
    rng = np.random.default_rng(M + N)
    K, gs = 512, 64
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32)).astype(mx.float16)
    wq, s, b = mx.quantize(w, group_size=gs, bits=4)
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(mx.float16)
    want = np.array(on(mx.cpu, mx.quantized_matmul, x, wq, s, b, transpose=True,
                       group_size=gs, bits=4).astype(mx.float32))
    got = np.array(on(mx.gpu, mixbits.quantized_matmul, x, wq, s, b, group_size=gs,
                      bits=4).astype(mx.float32))
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@pytest.mark.parametrize("M", [1, 3])
def test_gather_sorted_gemv_runs_gpu_matches_mlx(M):
    # Sorted pairs spread over many experts (< 8 rows each): the gathered
    # GEMV in 8-row blocks walking runs of equal expert.
    rng = np.random.default_rng(70 + M)
    E, N, K, gs = 32, 300, 512, 64
    w = mx.array(rng.standard_normal((E, N, K)).astype(np.float32)).astype(mx.float16)
    wq, s, b = mx.quantize(w, group_size=gs, bits=4)
    ids = mx.array(np.sort(rng.integers(0, E, 72)).astype(np.uint32))
    x = mx.array(rng.standard_normal((72, M, K)).astype(np.float32)).astype(mx.float16)
    mx.eval(wq, s, b, x, ids)
    want = np.array(on(mx.cpu, mx.gather_qmm, x, wq, s, b, None, ids, transpose=True,
                       group_size=gs, bits=4, sorted_indices=True).astype(mx.float32))
    got = np.array(on(mx.gpu, mixbits.gather_quantized_matmul, x, wq, s, b, None, ids,
                      group_size=gs, bits=4, sorted_indices=True).astype(mx.float32))
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_gather_gpu_runs_the_metal_kernel_and_matches_cpu(tmp_path):
    # Mixed segments with a permutation, both operands gathered with batch
    # dims, an index out of range (NaN matrix, as on the CPU), a strided x.
    rng = np.random.default_rng(3)
    E, n, K = 5, 70, 640
    specs = [(8, 128, 128), (5, 32, 96), (4, 64, 320), (2, 32, 96)]
    qt = mixbits.quantize(mx.array(rng.standard_normal((E * n, K)).astype(np.float32)), specs,
                          perm=rng.permutation(K))
    segs = [Segment(sg.bits, sg.group_size, sg.k,
                    *(a.reshape(E, n, -1) for a in (sg.wq, sg.scales, sg.biases)))
            for sg in qt.segments]
    qt = QuantizedTensor(segs, qt.perm)
    x = mx.array(rng.standard_normal((4, 2, K, 3)).astype(np.float32)).swapaxes(-1, -2)
    lhs = mx.array(np.array([[0], [7], [3]], np.uint32))
    rhs = mx.array(np.array([4, 0, 9, 2], np.uint32))  # 9: out of range
    with mx.stream(mx.gpu):
        y = mixbits.gather_qmatmul(x, qt, lhs, rhs)
    ops = graph_ops(y, tmp_path)
    assert "MixedGatherQMM" in ops and "GatherMM" not in ops, ops
    mx.eval(y)
    cpu = np.array(on(mx.cpu, mixbits.gather_qmatmul, x, qt, lhs, rhs))
    gpu = np.array(y)
    np.testing.assert_array_equal(np.isnan(gpu), np.isnan(cpu))
    assert np.isnan(gpu[:, 2]).all() and np.isfinite(gpu[:, [0, 1, 3]]).all()
    ok = np.isfinite(cpu)
    np.testing.assert_allclose(gpu[ok], cpu[ok], rtol=1e-4, atol=1e-4 * np.abs(cpu[ok]).max())


def test_gather_gpu_gradients_and_switch_linear():
    # The primitive's vjp on a GPU stream (dx through the gathered
    # transposed kernel, segmented_mm for the scales) against the CPU's, and
    # mlx-lm's QuantizedSwitchLinear drop-in.
    from mlx_lm.models.switch_layers import SwitchLinear

    from mixbits.nn import MixedQuantizedSwitchLinear

    rng = np.random.default_rng(4)
    wq, s, b = mx.quantize(mx.array(rng.standard_normal((4, 24, 128)).astype(np.float32)),
                           group_size=32, bits=4)
    x = mx.array(rng.standard_normal((6, 1, 1, 128)).astype(np.float32))
    rhs = mx.array(rng.integers(0, 4, (6, 2)).astype(np.uint32))

    def loss(x, s, b):
        y = mixbits.gather_quantized_matmul(x, wq, s, b, None, rhs, group_size=32, bits=4)
        return (y * y).sum()

    g_cpu = on(mx.cpu, mx.grad(loss, argnums=(0, 1, 2)), x, s, b)
    g_gpu = on(mx.gpu, mx.grad(loss, argnums=(0, 1, 2)), x, s, b)
    for gc, gg in zip(g_cpu, g_gpu):
        gc, gg = np.array(gc), np.array(gg)
        np.testing.assert_allclose(gg, gc, rtol=1e-3, atol=1e-3 * np.abs(gc).max())

    stock = SwitchLinear(128, 24, 4, bias=True).to_quantized(group_size=64, bits=4)
    ours = MixedQuantizedSwitchLinear.from_quantized(stock)
    order = mx.argsort(rhs.flatten())
    xs, ids = x.reshape(-1, 1, 128)[order // 2], rhs.flatten()[order]
    for args, kw in [((x, rhs), {}), ((xs, ids), {"sorted_indices": True})]:
        want = np.array(on(mx.cpu, stock, *args, **kw))
        got = np.array(on(mx.gpu, ours, *args, **kw))
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("M", [1, 3, 8, 9])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_gather_gpu_gradient_wrt_x_matches_cpu(M, dtype, tmp_path):
    # dx of the gathered matmul: on the GPU the Metal gathered transposed
    # kernel (MixedGatherQMMT) up to 8 rows per matrix, dequantize +
    # gather_mm above; on the CPU the backend's kernel. Mixed segments, a
    # permutation, 3 column blocks, N = 70; several pairs write one dx
    # matrix (lhs broadcast against rhs), some dx matrices none.
    rng = np.random.default_rng(10 + M)
    E, n, K = 5, 70, 640
    specs = [(8, 128, 128), (5, 32, 96), (4, 64, 320), (2, 32, 96)]
    qt = mixbits.quantize(mx.array(rng.standard_normal((E * n, K)).astype(np.float32)), specs,
                          perm=rng.permutation(K), dtype=dtype)
    segs = [Segment(sg.bits, sg.group_size, sg.k,
                    *(a.reshape(E, n, -1) for a in (sg.wq, sg.scales, sg.biases)))
            for sg in qt.segments]
    qt = QuantizedTensor(segs, qt.perm)
    x = mx.array(rng.standard_normal((4, 2, M, K)).astype(np.float32)).astype(dtype)
    lhs = mx.array(np.array([[6], [1], [6]], np.uint32))
    rhs = mx.array(np.array([4, 0, 4, 2], np.uint32))
    gy = mx.array(rng.standard_normal((3, 4, M, n)).astype(np.float32)).astype(dtype)

    def dx(x):
        return mx.vjp(lambda x: mixbits.gather_qmatmul(x, qt, lhs, rhs), [x], [gy])[1][0]

    with mx.stream(mx.gpu):
        g = dx(x)
    ops = graph_ops(g, tmp_path)
    assert ("MixedGatherQMMT" in ops) == (M <= 8), ops
    mx.eval(g)
    cpu = np.array(on(mx.cpu, dx, x).astype(mx.float32))
    gpu = np.array(g.astype(mx.float32))
    assert g.dtype == dtype
    tol = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 5e-2}[dtype]
    np.testing.assert_allclose(gpu, cpu, rtol=tol, atol=tol * np.abs(cpu).max())
    assert (gpu.reshape(8, M, K)[[0, 2, 3, 4, 5, 7]] == 0).all()
    # An expert index out of range: every element NaN, as on the CPU.
    bad = mx.array(np.array([4, 0, 5, 2], np.uint32))
    with mx.stream(mx.gpu):
        gb = mx.vjp(lambda x: mixbits.gather_qmatmul(x, qt, lhs, bad), [x], [gy])[1][0]
        mx.eval(gb)
    if M <= 8:
        assert np.isnan(np.array(gb.astype(mx.float32))).all()


@pytest.mark.parametrize("M", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_qmatmul_gpu_gradient_wrt_x_matches_cpu(M, dtype, tmp_path):
    # dx through MixedQuantizedLinear: on the GPU the Metal transposed
    # kernel (MixedQMatmulT) up to 8 rows, dequantize + matmul above; on the
    # CPU the backend's transposed kernel. Mixed segments, a permutation,
    # 3 column blocks and N = 70 (no multiple of the kernel's 8 row slices).
    import mlx.nn as nn

    from mixbits.nn import MixedQuantizedLinear

    rng = np.random.default_rng(M)
    K, N = 640, 70
    lin = nn.Linear(K, N)
    lin.weight = mx.array(rng.standard_normal((N, K)).astype(np.float32))
    lin.set_dtype(dtype)
    layer = MixedQuantizedLinear.from_linear(
        lin, [(8, 128, 128), (5, 32, 96), (4, 64, 320), (2, 32, 96)],
        perm=rng.permutation(K))
    x = mx.array(rng.standard_normal((2, M, K)).astype(np.float32)).astype(dtype)
    gy = mx.array(rng.standard_normal((2, M, N)).astype(np.float32)).astype(dtype)

    def dx(x):
        return mx.vjp(layer, [x], [gy])[1][0]

    cpu = on(mx.cpu, dx, x)
    gpu = on(mx.gpu, dx, x)
    assert gpu.dtype == dtype
    cpu, gpu = np.array(cpu.astype(mx.float32)), np.array(gpu.astype(mx.float32))
    tol = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 5e-2}[dtype]
    np.testing.assert_allclose(gpu, cpu, rtol=tol, atol=tol * np.abs(cpu).max())
    with mx.stream(mx.gpu):
        ops = graph_ops(dx(x), tmp_path)
    assert ("MixedQMatmulT" in ops) == (2 * M <= 8), ops


def test_qmatmul_gpu_gradient_with_a_repeated_perm_entry_matches_cpu():
    # A perm the Python layer never makes (the builder checks its shape
    # only): repeated columns sum and a missing one gets 0, on the GPU
    # (every threadgroup of the one dispatch finds the repeat in its bit
    # map and computes its own columns by the sum) as on the CPU.
    from mixbits import _ext

    rng = np.random.default_rng(7)
    K, N = 192, 33
    qt = mixbits.quantize(mx.array(rng.standard_normal((N, K)).astype(np.float32)),
                          [(4, 32, 64), (6, 64, 128)], perm=rng.permutation(K))
    perm = np.array(qt.perm)
    perm[100] = perm[5]
    bad = mx.array(perm)
    x = mx.array(rng.standard_normal((3, K)).astype(np.float32))
    gy = mx.array(rng.standard_normal((3, N)).astype(np.float32))

    def dx(x):
        f = lambda x: _ext.qmatmul(x, bad, qt.arrays(), qt.specs, 0, 0)
        return mx.vjp(f, [x], [gy])[1][0]

    cpu, gpu = np.array(on(mx.cpu, dx, x)), np.array(on(mx.gpu, dx, x))
    np.testing.assert_allclose(gpu, cpu, rtol=1e-4, atol=1e-4 * np.abs(cpu).max())
    lost = sorted(set(range(K)) - set(perm.tolist()))
    assert len(lost) == 1 and (gpu[:, lost] == 0).all()


@pytest.mark.parametrize("form", ["direct", "logits", "probs32", "probs16"])
def test_kl_gpu_matches_cpu_in_every_mode(form):
    rng = np.random.default_rng(5)
    a = mx.array((3 * rng.standard_normal((8, 32000))).astype(np.float32)).astype(mx.float16)
    b = (a.astype(mx.float32) + 0.1 * mx.array(rng.standard_normal((8, 32000)).astype(
        np.float32))).astype(mx.float16)

    def run():
        if form == "direct":
            return mkl.kl_divergence(a, b)
        return mkl.KLReference(a, form=form).compare(b).kl

    cpu = np.array(on(mx.cpu, run))
    gpu = np.array(on(mx.gpu, run))
    # Both within ~2e-7 of float64 (bench/KL.md); so within 4e-7 of each other.
    np.testing.assert_allclose(gpu, cpu, rtol=1e-5, atol=4e-7)


def test_bad_input_refused_on_the_gpu_before_dispatch():
    x = mx.zeros((2, 64))
    w = mx.zeros((8, 64))
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    with mx.stream(mx.gpu):
        with pytest.raises(ValueError):
            mixbits.quantized_matmul(x, wq, s, b, group_size=64, bits=4, backend="ref")
        with pytest.raises(ValueError):
            mixbits.quantized_matmul(mx.zeros((2, 63)), wq, s, b, group_size=64, bits=4)
        with pytest.raises(ValueError):
            mkl.kl_divergence(mx.zeros((2, 5)), mx.zeros((2, 5)), backend="ref")
        with pytest.raises(ValueError):
            mkl.kl_divergence(mx.zeros((2, 5)), mx.zeros((2, 6)))
