"""activations="int8-all": the int8 contract (cpp/qmatmul_int8/kernel.h,
bench/INT8.md) at every number of rows, on MLX's layout (the <= 16-row
kernels over row chunks) and on the repacked one (the GEMV in passes of 8
rows; on AVX512-VNNI also the blocked GEMM of repacked_vnni_gemm.cpp, off
by default -- measured no faster here -- and forced on by the `route`
fixture). Expected values come from the independent numpy model
(tests/int_contract.py); int8-all must also equal int8 bit for bit at
M <= 16, and a call of many rows must equal the same rows called 16 at a
time bit for bit (the contract quantizes each row on its own, and the GEMM
keeps the GEMV's float epilogue)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mixbits
from mixbits import _ext, ops
from mixbits._backends import BACKENDS as BACKEND_IDS
from int_contract import contract_model, poison_padding, rand_qt
from reference import OUT_EPS, to_f64

ACT = "int8-all"
MS = (17, 31, 64, 129, 300)
# CPU backends with integer kernels on this machine (neon is arm64's).
BACKENDS = [b for b in ops.available_backends() if b != "neon"] + ["auto"]


def check_model(y, x, qt, out_dtype=mx.float32, slack=1.0):
    """y equals the numpy int8 contract to float rounding of the kernels'
    partial sums (the tolerance of tests/test_qmatmul_int8.py)."""
    y_star, _, _, mag2, _ = contract_model(x, qt, "int8")
    y = to_f64(y).reshape(y_star.shape)
    tol = slack * 4e-6 * mag2 + 2 * OUT_EPS[out_dtype] * np.abs(y_star) + 1e-30
    np.testing.assert_array_less(np.abs(y - y_star), tol)


def f32(a: mx.array) -> np.ndarray:
    """a as float32 numpy (exact for every float dtype: bitwise comparisons)."""
    return np.array(a.astype(mx.float32))


def in_chunks(x, w, **kw):
    """The same call, 16 rows at a time (int8 takes <= 16 rows)."""
    parts = [f32(mixbits.qmatmul(x[m:m + 16], w, **kw)) for m in range(0, x.shape[0], 16)]
    return np.concatenate(parts, 0)


def _has_gemm():
    _ext.set_repacked_gemm_min_m(1)
    try:
        return _ext.repacked_gemm_min_m(0) == 1
    finally:
        _ext.set_repacked_gemm_min_m(-1)


# The repacked int8 calls' two kernels: the GEMV's passes (default) and,
# where the CPU has it, the blocked GEMM forced from 1 row.
@pytest.fixture(params=["passes"] + (["gemm"] if _has_gemm() else []))
def route(request):
    _ext.set_repacked_gemm_min_m(1 if request.param == "gemm" else 0)
    yield request.param
    _ext.set_repacked_gemm_min_m(-1)


# ---------------------------------------------------------------- contract


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_every_width_and_group_size(bits, gs, route):
    """Both layouts compute the contract at every M; N = 37 (a padded last
    block), K = 1280 (two full K-chunks of 512 columns and a half one)."""
    rng = np.random.default_rng(bits * 1000 + gs)
    qt = rand_qt(rng, 37, [(bits, gs, 1280)])
    rt = ops.repack(qt)
    for M in MS:
        x = mx.array(rng.standard_normal((M, 1280)).astype(np.float32))
        y_r = mixbits.qmatmul(x, rt, activations=ACT)
        y_o = mixbits.qmatmul(x, qt, activations=ACT)
        check_model(y_r, x, qt)
        check_model(y_o, x, qt)
        # each layout: the same rows 16 at a time, bit for bit
        np.testing.assert_array_equal(np.array(y_r), in_chunks(x, rt, activations="int8"),
                                      err_msg=f"repacked M={M}")
        np.testing.assert_array_equal(np.array(y_o), in_chunks(x, qt, activations="int8"),
                                      err_msg=f"original M={M}")


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(seed, route):
    """N not a multiple of 16, several groups, random M above 16."""
    rng = np.random.default_rng(100 + seed)
    bits = int(rng.choice([2, 3, 4, 5, 6, 8]))
    gs = int(rng.choice([32, 64, 128]))
    n = int(rng.integers(1, 90))
    k = gs * int(rng.integers(1, 24))
    M = int(rng.integers(17, 200))
    qt = rand_qt(rng, n, [(bits, gs, k)])
    rt = ops.repack(qt)
    x = mx.array((rng.standard_normal((M, k)) * rng.uniform(0.01, 100)).astype(np.float32))
    y_r = mixbits.qmatmul(x, rt, activations=ACT)
    check_model(y_r, x, qt)
    check_model(mixbits.qmatmul(x, qt, activations=ACT), x, qt)
    np.testing.assert_array_equal(np.array(y_r), in_chunks(x, rt, activations="int8"))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_mixed_segments_perm_and_dtypes(dtype, route):
    rng = np.random.default_rng(7)
    segs = [(8, 32, 64), (6, 64, 128), (5, 32, 96), (4, 64, 576), (3, 128, 256), (2, 128, 256),
            (2, 32, 96), (3, 32, 64)]
    qt = rand_qt(rng, 45, segs, perm=True, dtype=dtype if dtype != mx.float32 else mx.float16)
    rt = ops.repack(qt)
    for M in (17, 129):
        x = mx.array(rng.standard_normal((3, M, qt.shape[1])).astype(np.float32)).astype(dtype)
        for w in (rt, qt):
            y = mixbits.qmatmul(x, w, activations=ACT)
            assert y.shape == (3, M, 45) and y.dtype == dtype
            check_model(y, x, qt, dtype)
        x2 = x.reshape(-1, qt.shape[1])
        np.testing.assert_array_equal(f32(mixbits.qmatmul(x2, rt, activations=ACT)),
                                      in_chunks(x2, rt, activations="int8"))


def test_float32_scales(route):
    rng = np.random.default_rng(17)
    qt = rand_qt(rng, 50, [(4, 64, 640), (3, 32, 128)], dtype=mx.float32)
    rt = ops.repack(qt)
    x = mx.array(rng.standard_normal((70, 768)).astype(np.float32))
    check_model(mixbits.qmatmul(x, rt, activations=ACT), x, qt)


def test_layouts_agree(route):
    """Repacked and original layouts: the same contract, different float
    epilogues, so equal to float rounding (not bit for bit)."""
    rng = np.random.default_rng(21)
    qt = rand_qt(rng, 200, [(4, 64, 512), (2, 32, 256), (6, 128, 256)], perm=True)
    rt = ops.repack(qt)
    x = mx.array(rng.standard_normal((129, 1024)).astype(np.float32))
    _, _, _, mag2, _ = contract_model(x, qt, "int8")
    a = to_f64(mixbits.qmatmul(x, rt, activations=ACT))
    b = to_f64(mixbits.qmatmul(x, qt, activations=ACT))
    np.testing.assert_array_less(np.abs(a - b), 8e-6 * mag2 + 1e-30)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_gives_the_contract(backend):
    """ref, avx2 (AVX2-only kernels), avx512 and auto: the same contract
    above 16 rows, on both layouts."""
    rng = np.random.default_rng(31)
    qt = rand_qt(rng, 21, [(4, 64, 256), (3, 32, 128), (8, 128, 128)], perm=True)
    rt = ops.repack(qt)
    x = mx.array(rng.standard_normal((40, 512)).astype(np.float32))
    for w in (qt, rt):
        y = mixbits.qmatmul(x, w, activations=ACT, backend=backend)
        check_model(y, x, qt)
        np.testing.assert_array_equal(np.array(y), in_chunks(x, w, activations="int8", backend=backend))


def test_default_route():
    """Off by default on every CPU (repack.h, kRepackGemmMinM: measured no
    faster than the passes); the override is process-wide and restorable."""
    for b in BACKENDS:
        assert _ext.repacked_gemm_min_m(BACKEND_IDS[b]) is None, b
    if _has_gemm():
        _ext.set_repacked_gemm_min_m(40)
        try:
            assert _ext.repacked_gemm_min_m(0) == 40
        finally:
            _ext.set_repacked_gemm_min_m(-1)
        assert _ext.repacked_gemm_min_m(0) is None


# ---------------------------------------------------------------- int8 below 17 rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_equals_int8_up_to_16_rows(backend):
    rng = np.random.default_rng(41)
    qt = rand_qt(rng, 37, [(4, 64, 256), (3, 32, 128), (5, 64, 128)], perm=True)
    rt = ops.repack(qt)
    for M in range(1, 17):
        x = mx.array(rng.standard_normal((M, 512)).astype(np.float32))
        for w in (qt, rt):
            np.testing.assert_array_equal(
                np.array(mixbits.qmatmul(x, w, activations=ACT, backend=backend)),
                np.array(mixbits.qmatmul(x, w, activations="int8", backend=backend)),
                err_msg=f"{backend} M={M}")


def test_int8_keeps_its_meaning():
    """int8 above 16 rows is still the float path; int8-all is not."""
    rng = np.random.default_rng(42)
    qt = rand_qt(rng, 33, [(4, 64, 256)])
    x = mx.array(rng.standard_normal((40, 256)).astype(np.float32))
    f = np.array(mixbits.qmatmul(x, qt))
    np.testing.assert_array_equal(np.array(mixbits.qmatmul(x, qt, activations="int8")), f)
    assert not np.array_equal(np.array(mixbits.qmatmul(x, qt, activations=ACT)), f)


# ---------------------------------------------------------------- edges


def test_inf_nan_take_the_float_path():
    rng = np.random.default_rng(4)
    qt = rand_qt(rng, 40, [(4, 64, 128), (3, 32, 128)], perm=True)
    rt = ops.repack(qt)
    x = rng.standard_normal((70, 256)).astype(np.float32)
    for special in ([(0, 17, np.inf)], [(69, 5, -np.inf)], [(33, 9, np.nan)]):
        xs = x.copy()
        for i, j, v in special:
            xs[i, j] = v
        for w in (qt, rt):
            f = np.array(mixbits.qmatmul(mx.array(xs), w))
            i8 = np.array(mixbits.qmatmul(mx.array(xs), w, activations=ACT))
            np.testing.assert_array_equal(i8, f)  # same bits, NaN and inf included


def test_zero_rows_and_tiny_groups(route):
    rng = np.random.default_rng(5)
    qt = rand_qt(rng, 23, [(4, 64, 512), (2, 32, 256)])
    rt = ops.repack(qt)
    x = rng.standard_normal((20, 768)).astype(np.float32)
    x[0] = 0.0
    x[1, :128] = 0.0
    x[2] *= 1e-37  # every group below 2^-119: counts as zero
    x[3, ::7] *= 1e30
    for w in (qt, rt):
        y = mixbits.qmatmul(mx.array(x), w, activations=ACT)
        check_model(y, mx.array(x), qt)
        assert np.all(np.array(y)[[0, 2]] == 0.0)


def test_padding_rows_never_reach_the_output(route):
    rng = np.random.default_rng(12)
    qt = rand_qt(rng, 21, [(4, 64, 256), (2, 32, 64), (3, 32, 64)])  # 11 padding rows
    rt = ops.repack(qt)
    dirty = poison_padding(rng, rt)
    x = mx.array(rng.standard_normal((40, 384)).astype(np.float32))
    np.testing.assert_array_equal(np.array(mixbits.qmatmul(x, dirty, activations=ACT)),
                                  np.array(mixbits.qmatmul(x, rt, activations=ACT)))


def test_threads_do_not_change_the_result(route):
    rng = np.random.default_rng(6)
    qt = rand_qt(rng, 301, [(4, 64, 512), (2, 32, 256), (3, 64, 256)])
    rt = ops.repack(qt)
    x = mx.array(rng.standard_normal((129, 1024)).astype(np.float32))
    old = _ext.max_threads()
    try:
        for w in (rt, qt):
            _ext.set_max_threads(2)
            a = np.array(mixbits.qmatmul(x, w, activations=ACT))
            _ext.set_max_threads(1)
            b = np.array(mixbits.qmatmul(x, w, activations=ACT))
            np.testing.assert_array_equal(a, b)
    finally:
        _ext.set_max_threads(old)


# ---------------------------------------------------------------- switches


def test_names_have_one_source():
    assert list(ops.ACTIVATIONS) == list(_ext.activation_names())
    assert ops.ACTIVATIONS[ACT] == 3 and ops.ACTIVATIONS["int8"] == 1
    import argparse

    from mixbits.commands import bench, generate

    for mod in (bench, generate):
        p = argparse.ArgumentParser()
        mod.add_arguments(p)
        choices = next(a.choices for a in p._actions if a.dest == "activations")
        assert list(choices) == list(ops.ACTIVATIONS), mod.__name__


def test_refusals():
    rng = np.random.default_rng(8)
    qt = rand_qt(rng, 8, [(4, 64, 128)])
    rt = ops.repack(qt)
    x = mx.zeros((20, 128))
    for w in (qt, rt):
        with pytest.raises(ValueError, match="activations must be one of"):
            mixbits.qmatmul(x, w, activations="int8_all")
        with pytest.raises(ValueError, match="activations must be one of"):
            mixbits.qmatmul(x, w, activations="INT8-ALL")
        with pytest.raises(TypeError, match="activations must be a str"):
            mixbits.qmatmul(x, w, activations=3)
    # the C++ ops check the enum value too (MLX-style ValueError, no crash)
    for bad in (4, -1, 1 << 20):
        with pytest.raises(ValueError, match="int8-all"):
            _ext.qmatmul(x, qt.perm, qt.arrays(), qt.specs, 0, bad)
        with pytest.raises(ValueError, match="int8-all"):
            _ext.repacked_qmatmul(x, None, rt.arrays(), rt.specs, 8, 0, bad)
    s = qt.segments[0]
    stack = mixbits.QuantizedTensor([mixbits.layout.Segment(
        4, 64, 128, mx.stack([s.wq] * 2), mx.stack([s.scales] * 2), mx.stack([s.biases] * 2))])
    # a stack takes the contract per matrix (tests/test_gather_int8.py)
    xb = mx.array(np.random.default_rng(1).standard_normal((2, 20, 128)).astype(np.float32))
    np.testing.assert_array_equal(np.array(mixbits.qmatmul(xb, stack, activations=ACT)[0]),
                                  np.array(mixbits.qmatmul(xb[0], qt, activations=ACT)))
    for bad in (4, -1):
        with pytest.raises(ValueError, match="int8-all"):
            _ext.gather_qmatmul(xb, None, stack.arrays(), stack.specs, None, mx.array([0]), activations=bad)
    y = mixbits.quantized_matmul(x + 1, s.wq, s.scales, s.biases, 64, 4, activations=ACT)
    np.testing.assert_array_equal(np.array(y), np.array(mixbits.qmatmul(x + 1, qt, activations=ACT)))


def test_layer_attribute_and_patch():
    rng = np.random.default_rng(9)
    lin = nn.Linear(256, 48)
    lin.weight = mx.array(rng.standard_normal((48, 256)).astype(np.float32))
    model = nn.Sequential(nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4))
    x = mx.array(rng.standard_normal((40, 256)).astype(np.float32))
    mixbits.patch(model, activations=ACT, functions=False, repack=True)
    layer = model.layers[0]
    assert layer.activations == ACT and layer.is_repacked
    check_model(model(x) - layer.bias, x, layer.quantized_tensor())
    with pytest.raises(ValueError, match="activations"):
        layer.activations = "int8 all"
