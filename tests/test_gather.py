"""mixbits.gather_quantized_matmul / gather_qmatmul against mx.gather_qmm
(transpose=True) and a float64 reference; index validation as MLX's;
gradients; MixedQuantizedSwitchLinear against mlx-lm's
QuantizedSwitchLinear."""

import itertools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

import mixbits
from mixbits.layout import BITS, GROUP_SIZES, QuantizedTensor, Segment
from mixbits.nn import MixedQuantizedSwitchLinear
from reference import assert_matmul_close, to_f64

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
# Against MLX (both round to the dtype, MLX also its dequantized weights):
# max error relative to the largest entry. The float64 check is tight.
TOL = {mx.float32: 2e-5, mx.float16: 1e-2, mx.bfloat16: 8e-2}


def close(a, b, dtype, what=""):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    a, b = to_f64(a), to_f64(b)
    err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-6)
    assert err <= TOL[dtype], f"{what}: relative max error {err:.3g} > {TOL[dtype]}"


def rand(rng, shape, dtype=mx.float32):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def gather_f64(x, W, lhs, rhs):
    """out[i] = x[lhs[i]] @ W[rhs[i]].T in float64 with its error scale;
    x (Bx..., M, K) and W (Bw..., N, K) as float64 arrays."""
    xf = x.reshape(-1, *x.shape[-2:])
    Wf = W.reshape(-1, *W.shape[-2:])
    lhs = np.broadcast_to(np.arange(xf.shape[0]).reshape(x.shape[:-2]) if lhs is None else lhs,
                          np.broadcast_shapes(*(a.shape for a in (lhs, rhs) if a is not None)))
    rhs = np.broadcast_to(np.arange(Wf.shape[0]).reshape(W.shape[:-2]) if rhs is None else rhs, lhs.shape)
    xs, Ws = xf[lhs], np.swapaxes(Wf[rhs], -1, -2)
    return xs @ Ws, np.abs(xs) @ np.abs(Ws)


def dequant_f64(wq, s, b, group_size, bits):
    return to_f64(mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32),
                                group_size=group_size, bits=bits))


# (x shape prefix, w experts, lhs, rhs) as MoE layers and MLX's tests use them.
def index_cases(rng, E):
    return [
        ((6, 1), None, rng.integers(0, E, (6, 2))),          # tokens x top-2 experts
        ((3,), rng.integers(0, 3, (5,)), rng.integers(0, E, (5,))),  # both gathered
        ((4,), rng.integers(0, 4, (2, 3)), None if E != 3 else None),  # lhs only (rhs = arange(E))
    ]


@pytest.mark.parametrize("bits,group_size", list(itertools.product(BITS, GROUP_SIZES)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_mx_gather_qmm(bits, group_size, dtype):
    rng = np.random.default_rng(bits * 17 + group_size)
    E, n = 3, int(rng.integers(1, 24))
    k = group_size * int(rng.integers(1, 3))
    m = int(rng.integers(1, 4))
    wq, s, b = mx.quantize(rand(rng, (E, n, k), dtype), group_size=group_size, bits=bits)
    W = dequant_f64(wq, s, b, group_size, bits)
    for xb, lhs, rhs in [
        ((6, 1), None, rng.integers(0, E, (6, 2))),
        ((3,), rng.integers(0, 3, (5,)), rng.integers(0, E, (5,))),
        ((4,), rng.integers(0, 4, (2, E)), None),
    ]:
        x = rand(rng, (*xb, m, k), dtype)
        li = None if lhs is None else mx.array(lhs.astype(np.uint32))
        ri = None if rhs is None else mx.array(rhs.astype(np.int32))
        want = mx.gather_qmm(x, wq, s, b, li, ri, transpose=True, group_size=group_size, bits=bits)
        got = mixbits.gather_quantized_matmul(x, wq, s, b, li, ri, group_size=group_size, bits=bits)
        close(got, want, dtype, f"{xb} lhs={lhs is not None} rhs={rhs is not None}")
        ref, mag = gather_f64(to_f64(x), W, lhs, rhs)
        assert_matmul_close(got, ref, mag)


def test_sorted_indices_and_no_indices():
    rng = np.random.default_rng(1)
    wq, s, b = mx.quantize(rand(rng, (4, 16, 128)), group_size=64, bits=4)
    x = rand(rng, (8, 1, 1, 128))
    rhs = mx.array(np.sort(rng.integers(0, 4, (8, 1)), axis=0).astype(np.uint32))
    for li, ri, srt in [(None, rhs, True), (None, None, False)]:
        xx = x if ri is not None else rand(rng, (4, 3, 128))
        want = mx.gather_qmm(xx, wq, s, b, li, ri, transpose=True, group_size=64, bits=4, sorted_indices=srt)
        got = mixbits.gather_quantized_matmul(xx, wq, s, b, li, ri, group_size=64, bits=4, sorted_indices=srt)
        close(got, want, mx.float32)


def stack(rng, E, n, specs, dtype, perm=True):
    """Expert stack (E, n, ·) of one mixed layout, quantized by mixbits."""
    k = sum(s[2] for s in specs)
    qt = mixbits.quantize(rand(rng, (E * n, k), dtype), specs,
                          perm=rng.permutation(k) if perm else None, dtype=dtype)
    segs = [Segment(s.bits, s.group_size, s.k, *(a.reshape(E, n, -1) for a in (s.wq, s.scales, s.biases)))
            for s in qt.segments]
    return QuantizedTensor(segs, qt.perm)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("specs", [[(4, 64, 128), (2, 32, 64)], [(8, 128, 128), (5, 32, 32), (3, 64, 64)]],
                         ids=["4-2", "8-5-3"])
def test_mixed_segment_expert_stack(specs, dtype):
    rng = np.random.default_rng(len(specs))
    qt = stack(rng, 5, 11, specs, dtype)
    k = qt.shape[1]
    W = np.concatenate([dequant_f64(seg.wq, seg.scales, seg.biases, seg.group_size, seg.bits)
                        for seg in qt.segments], axis=-1)
    for _ in range(3):
        x = rand(rng, (7, 1, 2, k), dtype)
        rhs = rng.integers(0, 5, (7, 3))
        got = mixbits.gather_qmatmul(x, qt, rhs_indices=mx.array(rhs))
        ref, mag = gather_f64(to_f64(x)[..., np.asarray(qt.perm)], W, None, rhs)
        assert got.dtype == dtype
        assert_matmul_close(got, ref, mag)
        # And the same as MLX's gather_mm over the dequantized stack
        # (float32 only on MLX's CPU).
        want = mx.gather_mm(mx.take(x, qt.perm, axis=-1).astype(mx.float32),
                            mx.swapaxes(qt.dequantize(), -1, -2).astype(mx.float32),
                            None, mx.array(rhs)).astype(dtype)
        close(got, want, dtype)


def mlx_error(fn):
    try:
        mx.eval(fn())
    except Exception as e:  # noqa: BLE001 - we want its type
        return type(e)
    raise AssertionError("MLX accepted it")


BAD = [
    ("float indices", lambda r: (rand(r, (4, 1, 2, 64)), None, mx.array([0.0, 1.0]))),
    ("float lhs", lambda r: (rand(r, (4, 1, 2, 64)), mx.array([[0.5]]), mx.array([0]))),
    ("unbroadcastable", lambda r: (rand(r, (4, 2, 64)), mx.array([0, 1, 2]), mx.array([0, 1]))),
    ("lhs vs default rhs", lambda r: (rand(r, (4, 2, 64)), mx.array([0, 1]), None)),
    ("1-D x", lambda r: (rand(r, (64,)), None, mx.array([0]))),
    ("list indices", lambda r: (rand(r, (4, 1, 2, 64)), None, [0, 1])),
    ("wrong K", lambda r: (rand(r, (4, 1, 2, 32)), None, mx.array([0]))),
]


@pytest.mark.parametrize("name,make", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_refused_like_mlx(name, make):
    rng = np.random.default_rng(5)
    wq, s, b = mx.quantize(rand(rng, (3, 8, 64)), group_size=32, bits=4)
    x, li, ri = make(rng)
    etype = mlx_error(lambda: mx.gather_qmm(x, wq, s, b, li, ri, transpose=True, group_size=32, bits=4))
    with pytest.raises(etype):
        mx.eval(mixbits.gather_quantized_matmul(x, wq, s, b, li, ri, group_size=32, bits=4))


def test_out_of_range_indices_give_nan_rows_not_garbage():
    """MLX cannot check index values when it builds the graph (nor do we);
    mixbits poisons exactly the affected output matrices with NaN."""
    rng = np.random.default_rng(6)
    wq, s, b = mx.quantize(rand(rng, (3, 8, 64)), group_size=32, bits=4)
    x = rand(rng, (4, 2, 64))
    for li, ri, bad in [(None, mx.array([0, 3, 2, 1]), 1), (None, mx.array([0, -1, 2, 1], dtype=mx.int32), 1),
                        (mx.array([0, 9, 2]), mx.array([0, 1, 2]), 1)]:
        got = np.asarray(mixbits.gather_quantized_matmul(x, wq, s, b, li, ri, group_size=32, bits=4))
        assert np.isnan(got[bad]).all()
        good = [i for i in range(got.shape[0]) if i != bad]
        assert np.isfinite(got[good]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradients_match_mx_gather_qmm(dtype):
    rng = np.random.default_rng(7)
    wq, s, b = mx.quantize(rand(rng, (4, 12, 128), dtype), group_size=32, bits=5)
    x = rand(rng, (6, 1, 3, 128), dtype)
    rhs = mx.array(rng.integers(0, 4, (6, 2)).astype(np.uint32))
    ct = rand(rng, (6, 2, 3, 12), dtype)
    ours = lambda x, s, b: mixbits.gather_quantized_matmul(x, wq, s, b, None, rhs, group_size=32, bits=5)
    ref = lambda x, s, b: mx.gather_qmm(x, wq, s, b, None, rhs, transpose=True, group_size=32, bits=5)
    _, g = mx.vjp(ours, [x, s, b], [ct])
    # MLX's own vjp, in float32 (its CPU gather_mm, which its vjp uses, is
    # float32-only), rounded to the dtype.
    f32 = [a.astype(mx.float32) for a in (x, s, b)]
    _, gr = mx.vjp(ref, f32, [ct.astype(mx.float32)])
    for name, a, c in zip(("x", "scales", "biases"), g, gr):
        close(a, c.astype(dtype), dtype, name)
    # jvp: MLX has none for GatherQMM; <jvp, ct> must equal <t, vjp(ct)>.
    t = [rand(rng, a.shape, dtype) for a in (x, s, b)]
    _, (j,) = mx.jvp(ours, [x, s, b], t)
    lhs_ = (j.astype(mx.float32) * ct.astype(mx.float32)).sum().item()
    rhs_ = sum((ti.astype(mx.float32) * gi).sum().item() for ti, gi in zip(t, gr))
    assert abs(lhs_ - rhs_) <= TOL[dtype] * 10 * max(abs(rhs_), 1.0)


def test_gradients_mixed_stack_with_lhs_and_perm():
    rng = np.random.default_rng(8)
    qt = stack(rng, 3, 9, [(4, 64, 64), (3, 32, 64)], mx.float32)
    x = rand(rng, (4, 2, 128))
    lhs, rhs = mx.array([3, 0, 0, 2, 1]), mx.array([2, 2, 0, 1, 0])
    sb = [a for seg in qt.segments for a in (seg.scales, seg.biases)]

    def ours(x, *sb):
        t = QuantizedTensor([Segment(seg.bits, seg.group_size, seg.k, seg.wq, sb[2 * i], sb[2 * i + 1])
                             for i, seg in enumerate(qt.segments)], qt.perm)
        return mixbits.gather_qmatmul(x, t, lhs, rhs)

    def ref(x, *sb):
        W = mx.concatenate([mx.dequantize(seg.wq, sb[2 * i], sb[2 * i + 1], group_size=seg.group_size,
                                          bits=seg.bits) for i, seg in enumerate(qt.segments)], axis=-1)
        return mx.gather_mm(mx.take(x, qt.perm, axis=-1), mx.swapaxes(W, -1, -2), lhs, rhs)

    ct = rand(rng, (5, 2, 9))
    _, g = mx.vjp(ours, [x, *sb], [ct])
    _, gr = mx.vjp(ref, [x, *sb], [ct])
    for i, (a, c) in enumerate(zip(g, gr)):
        close(a, c, mx.float32, f"arg {i}")


# ------------------------------------------------------------ the layer


@pytest.mark.parametrize("bits,group_size", [(4, 64), (3, 32), (8, 128), (2, 64)])
def test_switch_linear_drop_in(bits, group_size):
    rng = np.random.default_rng(bits)
    sl = SwitchLinear(128, 24, 4, bias=True)
    sl.bias = rand(rng, (4, 24))
    stock = sl.to_quantized(group_size=group_size, bits=bits)
    ours = MixedQuantizedSwitchLinear.from_quantized(stock)
    assert ours["weight"] is stock["weight"]  # arrays shared, not copied
    x = rand(rng, (5, 1, 1, 128))
    idx = mx.array(rng.integers(0, 4, (5, 2)))
    close(ours(x, idx), stock(x, idx), mx.float32)
    order = mx.argsort(idx.flatten())
    xs, ids = x.reshape(-1, 1, 128)[order // 2], idx.flatten()[order]
    close(ours(xs, ids, sorted_indices=True), stock(xs, ids, sorted_indices=True), mx.float32)
    assert {k for k, _ in nn.utils.tree_flatten(ours.trainable_parameters())} == {"bias"}


def test_switch_linear_mixed_segments_and_training():
    rng = np.random.default_rng(9)
    sl = SwitchLinear(192, 16, 3, bias=False)
    layer = MixedQuantizedSwitchLinear.from_switch_linear(sl, [(4, 64, 128), (2, 32, 64)],
                                                          perm=rng.permutation(192))
    W = to_f64(layer.quantized_tensor().dequantize(unpermute=True))
    assert np.abs(W - to_f64(sl.weight)).max() < 0.5  # it quantized this layer
    x = rand(rng, (4, 1, 1, 192))
    idx = mx.array(rng.integers(0, 3, (4, 2)))
    ref, mag = gather_f64(to_f64(x), W, None, np.asarray(idx))
    assert_matmul_close(layer(x, idx), ref, mag)
    # DWQ-style tuning of the experts' scales through the gather primitive.
    layer.unfreeze(keys=["scales", "biases"])
    names = {k for k, _ in nn.utils.tree_flatten(layer.trainable_parameters())}
    assert names == {f"segments.{i}.{n}" for i in range(2) for n in ("scales", "biases")}
    t = rand(rng, (4, 2, 1, 16))
    loss = lambda m: ((m(x, idx) - t) ** 2).mean()
    l0, grads = nn.value_and_grad(layer, loss)(layer)
    import mlx.optimizers as optim
    opt = optim.Adam(learning_rate=1e-2)
    for _ in range(5):
        _, grads = nn.value_and_grad(layer, loss)(layer)
        opt.update(layer, grads)
        mx.eval(layer.parameters())
    assert loss(layer).item() < l0.item()


def test_many_rows_of_one_expert_split_over_calls():
    """More rows than one backend call takes (8192): every chunk lands in
    its own output rows."""
    rng = np.random.default_rng(10)
    wq, s, b = mx.quantize(rand(rng, (2, 6, 64)), group_size=32, bits=4)
    x = rand(rng, (8300, 1, 1, 64))
    rhs = mx.array(np.r_[np.zeros(8250), np.ones(50)].astype(np.uint32)[:, None])
    got = mixbits.gather_quantized_matmul(x, wq, s, b, None, rhs, group_size=32, bits=4)
    want = mx.gather_qmm(x, wq, s, b, None, rhs, transpose=True, group_size=32, bits=4)
    close(got, want, mx.float32)
