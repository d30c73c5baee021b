"""The row-interleaved ("repacked") layout of the CPU's batch-1 integer GEMV
(cpp/qmatmul_int8/repack.h, python/mixbits/repack.py): the layout itself
against a numpy model, repack/unrepack as exact inverses, the repacked
kernels against the numpy model of the int8/int16 contract and against the
original layout's kernels, the paths that fall back to MLX's layout, the
refusals, and the layer / patch integration."""

import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mixbits
from mixbits import _ext, ops
from mixbits.errors import UsageError
from mixbits.repack import REPACK_BITS, REPACK_ROWS, RepackedTensor
from cpu_flags import cpu_flags
from int_contract import CONTRACTS, codes_scales_biases, contract_model, poison_padding, rand_qt
from reference import OUT_EPS, to_f64
from test_gather_int8 import rand_stack

R = REPACK_ROWS
VNNI = "avx512" in ops.available_backends()  # the repacked kernels' ISA (checked below)


@pytest.fixture(params=sorted(CONTRACTS))
def act(request):
    return request.param


# The repacked kernels: auto (AVX512-VNNI on a CPU that has it, NEON on
# arm64) and, where the CPU has them, the AVX2 ones forced (arm64 has no
# avx2 backend: forcing it would be refused, not a kernel test).
@pytest.fixture(params=["auto"] + (["avx2"] if "avx2" in ops.available_backends() else []))
def kernel(request):
    return request.param


def raw(a: mx.array) -> np.ndarray:
    """An array's bits (2- or 4-byte elements) for exact comparisons."""
    return np.array(a.view(mx.uint16 if a.dtype in (mx.float16, mx.bfloat16) else mx.uint32))


def interleaved_model(a: np.ndarray) -> np.ndarray:
    """[N, cols] -> [ceil(N/16), cols, 16], zero rows appended: the layout."""
    n, cols = a.shape
    nb = -(-n // R)
    pad = np.zeros((nb * R, cols), a.dtype)
    pad[:n] = a
    return pad.reshape(nb, R, cols).transpose(0, 2, 1)


# Bit of the 3-bit chunk's high word holding bit 2 of code 4p+k of the first
# 16 codes, and of code 16+4p+k (repack.h): written out as documented, not
# with the C++ formula.
H_LOW = [[8 * p + 2 + k for k in range(4)] for p in range(4)]
H_HIGH = [[8 * p + [6, 7, 0, 1][k] for k in range(4)] for p in range(4)]


def split3_model(codes: np.ndarray) -> np.ndarray:
    """MLX's 3-bit codes [N, k] -> the 3-bit repacked words [N, 3k/32] before
    the interleave: per chunk of 32 codes (L0, L1, H), L0/L1 the low 2 bits
    of codes 0..15 / 16..31 in MLX's 2-bit layout, H their 3rd bits."""
    q = codes.astype(np.uint64).reshape(codes.shape[0], -1, 32)
    out = np.zeros((q.shape[0], q.shape[1], 3), np.uint64)
    for i in range(16):
        out[..., 0] |= (q[..., i] & 3) << (2 * i)
        out[..., 1] |= (q[..., 16 + i] & 3) << (2 * i)
    for p in range(4):
        for k in range(4):
            out[..., 2] |= ((q[..., 4 * p + k] >> 2) & 1) << H_LOW[p][k]
            out[..., 2] |= ((q[..., 16 + 4 * p + k] >> 2) & 1) << H_HIGH[p][k]
    return out.reshape(q.shape[0], -1).astype(np.uint32)


# 5 and 6 bits (repack.h): per chunk of 32 codes, L0..L3 the low 4 bits of
# codes 8w..8w+7 in MLX's 4-bit layout, then the high bits of code 8w+2p+k
# in byte p of a high word, at the bit of this table (written out as
# documented): 5 bits one word, [w][k]; 6 bits two words (H0: codes 0..15,
# H1: 16..31), two bits each, [w % 2][k].
H5 = [[4, 5], [6, 7], [0, 1], [2, 3]]
H6 = [[4, 6], [0, 2]]


def split56_model(codes: np.ndarray, bits: int) -> np.ndarray:
    """MLX's 5- or 6-bit codes [N, k] -> the repacked words [N, bits*k/32]
    before the interleave."""
    q = codes.astype(np.uint64).reshape(codes.shape[0], -1, 32)
    out = np.zeros((q.shape[0], q.shape[1], bits), np.uint64)
    for w in range(4):
        for i in range(8):
            c = q[..., 8 * w + i]
            out[..., w] |= (c & 15) << (4 * i)
            p, k = divmod(i, 2)
            if bits == 5:
                out[..., 4] |= (c >> 4) << (8 * p + H5[w][k])
            else:
                out[..., 4 + w // 2] |= (c >> 4) << (8 * p + H6[w % 2][k])
    return out.reshape(q.shape[0], -1).astype(np.uint32)


def check_contract(y, x, qt, act, out_dtype=mx.float32):
    """y (the repacked kernels' result) equals the numpy contract model to
    float rounding of the kernels' partial sums, as every SIMD backend of
    the original layout must (tests/test_qmatmul_int8.py)."""
    y_star, _, _, mag2, _ = contract_model(x, qt, act)
    y = to_f64(y).reshape(y_star.shape)
    tol = 4e-6 * mag2 + 2 * OUT_EPS[out_dtype] * np.abs(y_star) + 1e-30
    np.testing.assert_array_less(np.abs(y - y_star), tol)


# ---------------------------------------------------------------- layout


@pytest.mark.parametrize("bits", REPACK_BITS)
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_layout_and_exact_inverse(bits, gs, dtype):
    rng = np.random.default_rng(bits * 100 + gs)
    for n in (1, 16, 37):  # one padded block, one exact block, 2 blocks + tail
        qt = rand_qt(rng, n, [(bits, gs, 256)], dtype=dtype)
        rt = ops.repack(qt)
        assert isinstance(rt, RepackedTensor) and rt.shape == qt.shape
        s, r = qt.segments[0], rt.segments[0]
        words = raw(s.wq)
        if bits in (3, 5, 6):  # rewritten per chunk, from MLX's own codes
            codes = codes_scales_biases(qt)[0][0]
            words = split3_model(codes) if bits == 3 else split56_model(codes, bits)
            assert words.shape == raw(s.wq).shape
        for orig, rep in ((words, r.wq_r), (raw(s.scales), r.scales_r), (raw(s.biases), r.biases_r)):
            assert rep.dtype == mx.uint32 or raw(rep).dtype == orig.dtype
            np.testing.assert_array_equal(raw(rep), interleaved_model(orig))
        back = ops.unrepack(rt)
        for a, b in zip(back.arrays(), qt.arrays()):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(raw(a), raw(b))
        assert rt.nbytes == qt.nbytes + rt.padding_nbytes
        assert rt.padding_nbytes == (0 if n % R == 0 else (-n % R) * qt.nbytes // n)


def test_mixed_segments_and_perm_round_trip():
    rng = np.random.default_rng(3)
    segs = [(8, 32, 64), (4, 64, 192), (3, 64, 128), (2, 128, 256), (3, 32, 96), (4, 32, 64)]
    qt = rand_qt(rng, 45, segs, perm=True, dtype=mx.bfloat16)
    rt = ops.repack(qt)
    assert rt.specs == qt.specs and rt.perm is qt.perm
    back = ops.unrepack(rt)
    assert back.specs == qt.specs
    np.testing.assert_array_equal(np.array(back.perm), np.array(qt.perm))
    for a, b in zip(back.arrays(), qt.arrays()):
        np.testing.assert_array_equal(raw(a), raw(b))
    assert mixbits._ext.repack_rows() == R  # the Python layout constant is the C++ one


def test_arrays_start_on_a_cache_line():
    """repack_segment places every array's data on a 64-byte line: a repacked
    word is one line, loaded whole by the VNNI kernels, and MLX's CPU
    allocator's own buffers start 8 bytes past a 16-byte boundary (every
    such load then straddled two lines). Also for expert stacks: of whole
    blocks (one tall matrix, reshaped: a view of the same buffer), and of
    padded blocks (repacked per matrix, then joined into one aligned buffer)."""
    def address(a):
        return np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data

    rng = np.random.default_rng(5)
    for bits, gs, n, dtype in [(4, 64, 37, mx.float16), (3, 32, 16, mx.bfloat16),
                               (8, 128, 5, mx.float32), (2, 32, 100, mx.float16)]:
        rt = ops.repack(rand_qt(rng, n, [(bits, gs, 256), (4, 32, 64)], dtype=dtype))
        for a in rt.arrays():
            assert address(a) % 64 == 0, (bits, gs, n, a.shape, address(a) % 64)
    for n in (32, 37):  # whole blocks (one tall matrix), and per matrix joined by mx.stack
        stack = ops.repack(rand_stack(rng, E=3, N=n))
        assert stack.batch_shape == (3,)
        assert all(address(a) % 64 == 0 for a in stack.arrays()), n
        for s in stack.segments:  # so every expert's words start on a line too
            assert s.wq_r[0].nbytes % 64 == 0


# ---------------------------------------------------------------- kernels


@pytest.mark.parametrize("bits", REPACK_BITS)
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_kernels_compute_the_contract(bits, gs, act, kernel):
    rng = np.random.default_rng(bits * 1000 + gs)
    qt = rand_qt(rng, 37, [(bits, gs, 512)])  # 37: a padded tail block
    rt = ops.repack(qt)
    for M in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16):  # 9..16: two passes of 8 rows
        x = mx.array(rng.standard_normal((M, 512)).astype(np.float32))
        y = mixbits.qmatmul(x, rt, activations=act, backend=kernel)
        check_contract(y, x, qt, act)
        # and the original layout's kernels, to the same rounding
        y0 = to_f64(mixbits.qmatmul(x, qt, activations=act))
        y_star, _, _, mag2, _ = contract_model(x, qt, act)
        np.testing.assert_array_less(np.abs(to_f64(y) - y0), 8e-6 * mag2 + 4 * OUT_EPS[mx.float32] * np.abs(y0) + 1e-30)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_mixed_segments_with_perm_and_dtypes(dtype, act, kernel):
    rng = np.random.default_rng(7)
    segs = [(8, 32, 64), (4, 64, 192), (3, 128, 256), (2, 128, 256), (2, 32, 96), (3, 32, 64)]
    qt = rand_qt(rng, 29, segs, perm=True, dtype=dtype if dtype != mx.float32 else mx.float16)
    rt = ops.repack(qt)
    for M in (1, 3, 8):
        x = mx.array(rng.standard_normal((2, M, qt.shape[1])).astype(np.float32)).astype(dtype)
        y = mixbits.qmatmul(x, rt, activations=act, backend=kernel)
        assert y.shape == (2, M, 29) and y.dtype == dtype
        check_contract(y, x, qt, act, dtype)


def test_padding_rows_never_reach_the_output(act, kernel):
    """The kernels store the N real rows only: garbage in the last block's
    padding rows (zeros as built) changes nothing, also in the next x row's
    outputs where a 16-wide store would land."""
    rng = np.random.default_rng(12)
    qt = rand_qt(rng, 21, [(4, 64, 256), (2, 32, 64), (3, 32, 64)])  # 21 = 16 + 5: 11 padding rows
    rt = ops.repack(qt)
    dirty = poison_padding(rng, rt)
    x = mx.array(rng.standard_normal((4, 384)).astype(np.float32))
    np.testing.assert_array_equal(np.array(mixbits.qmatmul(x, dirty, activations=act, backend=kernel)),
                                  np.array(mixbits.qmatmul(x, rt, activations=act, backend=kernel)))


def test_threads_do_not_change_the_result(act, kernel):
    rng = np.random.default_rng(6)
    qt = rand_qt(rng, 301, [(4, 64, 512), (2, 32, 256), (3, 64, 256)])
    rt = ops.repack(qt)
    x = mx.array(rng.standard_normal((3, 1024)).astype(np.float32))
    old = mixbits._ext.max_threads()
    try:
        mixbits._ext.set_max_threads(2)
        a = np.array(mixbits.qmatmul(x, rt, activations=act, backend=kernel))
        mixbits._ext.set_max_threads(1)
        b = np.array(mixbits.qmatmul(x, rt, activations=act, backend=kernel))
    finally:
        mixbits._ext.set_max_threads(old)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", [b for b in ops.available_backends() if b != "neon"])
def test_other_paths_run_the_original_layout(backend, act):
    """Calls the repacked kernels do not take (the forced scalar reference,
    the float contract, more than 16 rows, inf/NaN in x) un-repack W and
    run exactly what the original layout runs: bitwise the same result --
    except above 16 rows where the backend reads the blocks in place."""
    rng = np.random.default_rng(11)
    qt = rand_qt(rng, 21, [(4, 64, 128), (8, 32, 64), (3, 32, 96)], perm=True)
    rt = ops.repack(qt)
    xs = [mx.array(rng.standard_normal((M, 288)).astype(np.float32)) for M in (1, 5, 17)]
    bad = np.array(xs[1])
    bad[2, 7] = np.inf
    bad[0, 3] = np.nan
    xs.append(mx.array(bad))
    for x in xs:
        for a in ("float", act):
            if a != "float" and backend != "ref" and x.shape[0] <= 16 and np.isfinite(np.array(x)).all():
                continue  # the repacked kernels (test_kernels_compute_the_contract)
            want = np.array(mixbits.qmatmul(x, qt, backend=backend, activations=a))
            got = np.array(mixbits.qmatmul(x, rt, backend=backend, activations=a))
            if x.shape[0] > 16 and _ext.repacked_float_min_m(ops._backend_id(backend)) is not None:
                # x86 reads the blocks in place above 16 rows (bitwise the
                # original layout's panels: test_repack_float); on AVX-512
                # MLX's layout takes its small-M kernels at 17 rows, another
                # summation order.
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                           err_msg=f"{backend} {a} M={x.shape[0]}")
                continue
            np.testing.assert_array_equal(got, want, err_msg=f"{backend} {a} M={x.shape[0]}")


def test_vnni_is_what_this_machine_runs():
    # The speed claim of bench/README.md is about the VNNI kernels; on this
    # x86 host they must be the ones auto takes (else this file tests only
    # the un-repacking fallback).
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    if "avx512_vnni" not in cpu_flags():
        pytest.skip("no AVX512-VNNI on this CPU")
    assert VNNI


# ---------------------------------------------------------------- refusals


def test_refusals(monkeypatch):
    rng = np.random.default_rng(8)
    assert set(REPACK_BITS) == set(mixbits.layout.BITS)  # 5 and 6 too (repack.h)
    with monkeypatch.context() as mp:  # the check of a width without a layout
        mp.setattr(mixbits.ops, "REPACK_BITS", (2, 3, 4, 8))
        qt = rand_qt(rng, 8, [(4, 64, 128), (5, 32, 96)])
        with pytest.raises(UsageError, match="no repacked layout"):
            ops.repack(qt)
    qt = rand_qt(rng, 8, [(4, 64, 128)])
    s = qt.segments[0]
    deep = mixbits.QuantizedTensor([mixbits.layout.Segment(4, 64, 128, mx.stack([s.wq] * 2)[None],
                                                          mx.stack([s.scales] * 2)[None],
                                                          mx.stack([s.biases] * 2)[None])])
    with pytest.raises(ValueError, match="2-D tensor or a stack with one batch dim"):
        ops.repack(deep)  # a stack of stacks (one batch dim: tests/test_repack_stacks.py)
    with pytest.raises(TypeError):
        ops.repack(object())
    with pytest.raises(TypeError):
        ops.unrepack(qt)
    rt = ops.repack(qt)
    with pytest.raises(ValueError, match="last dimension"):
        mixbits.qmatmul(mx.zeros((1, 64)), rt, activations="int8")
    # the C++ op checks the arrays it is given
    with pytest.raises(ValueError, match="wq must be uint32 of shape"):
        mixbits._ext.repacked_qmatmul(mx.zeros((1, 128)), None, qt.arrays(), qt.specs, 8, 0, 1)
    with pytest.raises(ValueError, match="no repacked layout"):
        mixbits._ext.repacked_qmatmul(mx.zeros((1, 128)), None, rt.arrays(), [(7, 64, 128)], 8, 0, 1)
    with pytest.raises(ValueError, match="no gradient"):
        mx.grad(lambda x: mixbits.qmatmul(x, rt, activations="int8").sum())(mx.ones((1, 128)))
    with pytest.raises(ValueError, match="no repacked layout"):
        mixbits._ext.unrepack_segment(*rt.arrays(), 8, 7)
    with pytest.raises(ValueError, match="no repacked layout"):
        mixbits._ext.repack_segment(*qt.arrays(), 7, 64)


# ---------------------------------------------------------------- layers


def _patched(rng, out_dims=48, bits=4):
    lin = nn.Linear(256, out_dims)
    lin.weight = mx.array(rng.standard_normal((out_dims, 256)).astype(np.float32))
    model = nn.Sequential(nn.QuantizedLinear.from_linear(lin, group_size=64, bits=bits))
    return model


@pytest.mark.parametrize("bits", [4, 3])
def test_layer_repack_unrepack(tmp_path, bits):
    rng = np.random.default_rng(9)
    model = _patched(rng, out_dims=40, bits=bits)  # 40: a padded tail block
    mixbits.patch(model, activations="int8", functions=False)
    layer = model.layers[0]
    x = mx.array(rng.standard_normal((3, 256)).astype(np.float32))
    qt = layer.quantized_tensor()
    before = {k: raw(v) for k, v in zip(("w", "s", "b"), qt.arrays())}
    y_float = np.array(mixbits.qmatmul(x, qt) + layer.bias)
    layer.repack()
    assert layer.is_repacked and mixbits.nn.repacked_layers(model) == ["layers.0"]
    assert "weight" not in layer and "repacked" in layer
    assert layer.output_dims == 40 and layer.input_dims == 256
    check_contract(model(x) - layer.bias, x, qt, "int8")
    # readers of the weight get MLX's layout back, bit for bit
    for k, a in zip(("w", "s", "b"), layer.quantized_tensor().arrays()):
        np.testing.assert_array_equal(raw(a), before[k])
    layer.activations = "float"  # correct (un-repacked per call), not fast
    np.testing.assert_array_equal(np.array(model(x)), y_float)
    with pytest.raises(UsageError, match="unrepack_layers"):
        mixbits.save(model, tmp_path / "m", config={"model_type": "x"})
    assert not (tmp_path / "m").exists()
    # the trainable bias needs no gradient through the weight; x does
    _, g = nn.value_and_grad(model, lambda m, x: m(x).sum())(model, x)
    np.testing.assert_array_equal(np.array(g["layers"][0]["bias"]), np.full(40, 3.0))
    with pytest.raises(ValueError, match="no gradient"):
        mx.grad(lambda x: model(x).sum())(x)
    assert mixbits.nn.unrepack_layers(model) == ["layers.0"]
    assert not layer.is_repacked and "weight" in layer
    for k, a in zip(("w", "s", "b"), (layer.weight, layer.scales, layer.biases)):
        np.testing.assert_array_equal(raw(a), before[k])
    assert "bias" in layer.trainable_parameters() and "weight" not in layer.trainable_parameters()
    np.testing.assert_array_equal(np.array(model(x)), y_float)


def test_patch_repack_memory_and_refusals(monkeypatch):
    # A width without a repacked layout (none of mixbits.layout.BITS now)
    # is simulated by taking 5 off the list repack_layers reads.
    monkeypatch.setattr(mixbits.nn.model, "REPACK_BITS", (2, 3, 4, 6, 8))
    rng = np.random.default_rng(10)
    model = nn.Sequential(*_patched(rng, 64).layers, *_patched(rng, 64, bits=3).layers)
    model.layers[1] = nn.QuantizedLinear.from_linear(nn.Linear(64, 32), group_size=64, bits=5)
    with pytest.raises(ValueError, match="activations='int8'"):
        mixbits.patch(model, activations="float", repack=True, functions=False)
    nbytes = sum(v.nbytes for _, v in mlx_flatten(model.parameters()))
    mixbits.patch(model, activations="int8", repack=True, functions=False)
    assert model.layers[0].is_repacked and not model.layers[1].is_repacked  # 5 bits: MLX layout
    # 64 rows: no padding, the repacked model holds exactly the same bytes
    assert sum(v.nbytes for _, v in mlx_flatten(model.parameters())) == nbytes
    x = mx.array(rng.standard_normal((1, 256)).astype(np.float32))
    assert model(x).shape == (1, 32)


def mlx_flatten(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


def test_patch_refuses_repack_where_the_cpu_has_no_repacked_kernel(monkeypatch):
    """Without the kernels every call would un-repack the weights (slower
    than not repacking): patch refuses before changing the model."""
    import mixbits.ops

    import platform

    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    x86_kernels = all(f in flags for f in ("avx2", "fma", "f16c"))
    arm64 = platform.machine() in ("arm64", "aarch64")  # NEON kernels (test_repacked_neon_emulated.py)
    assert mixbits.ops.repacked_kernels_available() == (x86_kernels or arm64)
    monkeypatch.setattr(mixbits.ops, "repacked_kernels_available", lambda: False)
    rng = np.random.default_rng(12)
    model = _patched(rng, 64)
    before = [type(m).__name__ for _, m in model.named_modules()]
    with pytest.raises(ValueError, match="no kernel for the repacked layout"):
        mixbits.patch(model, activations="int8", repack=True, functions=False)
    assert [type(m).__name__ for _, m in model.named_modules()] == before
    assert not mixbits.nn.repacked_layers(model)
