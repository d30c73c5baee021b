"""Derivatives of mixbits.qmatmul (vjp, jvp, vmap) against the same
function written with MLX's own mx.dequantize + matmul, which MLX
differentiates itself; one float64 numpy check of the formulas too."""

import itertools

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest

import mixbits
from mixbits.layout import BITS, GROUP_SIZES, QuantizedTensor, Segment
from mixbits.nn import MixedQuantizedLinear

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
# Max error relative to the largest reference entry: the reference itself
# rounds to the dtype (its matmuls and its dequantized W), ours accumulates
# the scales/biases gradients in float32.
TOL = {mx.float32: 2e-5, mx.float16: 1.5e-2, mx.bfloat16: 6e-2}


def close(a, b, dtype, what=""):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert a.dtype == b.dtype, (what, a.dtype, b.dtype)
    a = np.asarray(a.astype(mx.float32), dtype=np.float64)
    b = np.asarray(b.astype(mx.float32), dtype=np.float64)
    scale = max(np.abs(b).max(), 1e-6)
    err = np.abs(a - b).max() / scale
    assert err <= TOL[dtype], f"{what}: relative max error {err:.3g} > {TOL[dtype]}"


def rand(rng, shape, dtype):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def make(rng, n, specs, dtype, perm=True):
    k = sum(s[2] for s in specs)
    p = rng.permutation(k) if perm else None
    return mixbits.quantize(rand(rng, (n, k), dtype), specs, perm=p, dtype=dtype)


def functions(qt):
    """f(x, s0, b0, s1, b1, ...) through mixbits and through mx.dequantize."""
    segs, perm = qt.segments, qt.perm

    def ours(x, *sb):
        t = QuantizedTensor(
            [Segment(s.bits, s.group_size, s.k, s.wq, sb[2 * i], sb[2 * i + 1])
             for i, s in enumerate(segs)], perm)
        return mixbits.qmatmul(x, t)

    def ref(x, *sb):
        W = mx.concatenate(
            [mx.dequantize(s.wq, sb[2 * i], sb[2 * i + 1], group_size=s.group_size, bits=s.bits)
             for i, s in enumerate(segs)], axis=-1)
        xp = x if perm is None else mx.take(x, perm, axis=-1)
        return xp @ W.astype(x.dtype).T

    primals = [s_ for s in segs for s_ in (s.scales, s.biases)]
    return ours, ref, primals


def check_vjp_jvp(rng, qt, x, dtype):
    ours, ref, sb = functions(qt)
    primals = [x, *sb]
    ct = rand(rng, x.shape[:-1] + (qt.shape[0],), dtype)
    out_o, g_o = mx.vjp(ours, primals, [ct])
    out_r, g_r = mx.vjp(ref, primals, [ct])
    close(out_o[0], out_r[0], dtype, "forward")
    names = ["x"] + [f"{n}{i}" for i in range(len(qt.segments)) for n in ("scales", "biases")]
    for name, a, b in zip(names, g_o, g_r):
        close(a, b, dtype, "vjp " + name)
    tangents = [rand(rng, p.shape, p.dtype) for p in primals]
    _, t_o = mx.jvp(ours, primals, tangents)
    _, t_r = mx.jvp(ref, primals, tangents)
    close(t_o[0], t_r[0], dtype, "jvp")


@pytest.mark.parametrize("bits,group_size", list(itertools.product(BITS, GROUP_SIZES)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_single_segment_every_bits_group_dtype(bits, group_size, dtype):
    rng = np.random.default_rng(bits * 7 + group_size)
    n = int(rng.integers(1, 40))
    k = group_size * int(rng.integers(1, 4))
    qt = make(rng, n, [(bits, group_size, k)], dtype, perm=False)
    m = int(rng.integers(1, 9))
    check_vjp_jvp(rng, qt, rand(rng, (2, m, k), dtype), dtype)


MIXED = [
    [(4, 64, 128), (3, 32, 64), (2, 128, 128)],
    [(8, 32, 32), (6, 64, 64), (5, 128, 128)],
    [(3, 128, 256), (2, 32, 96)],
]


@pytest.mark.parametrize("specs", MIXED, ids=["4-3-2", "8-6-5", "3-2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_segments_with_perm(specs, dtype):
    rng = np.random.default_rng(len(specs) * 31 + specs[0][0])
    qt = make(rng, 23, specs, dtype, perm=True)
    k = qt.shape[1]
    for shape in [(k,), (5, k), (2, 3, k)]:
        check_vjp_jvp(rng, qt, rand(rng, shape, dtype), dtype)


def test_formulas_against_float64_numpy():
    """dx = dy·W (original column order), dL/ds = Σ_g (dyᵀx)·q, dL/db =
    Σ_g dyᵀx, computed in float64 from the unpacked codes."""
    from mixbits.layout import unpack_codes

    rng = np.random.default_rng(5)
    specs = [(4, 64, 128), (3, 32, 64)]
    qt = make(rng, 17, specs, mx.float32, perm=True)
    x = rand(rng, (6, 192), mx.float32)
    dy = rand(rng, (6, 17), mx.float32)
    ours, _, sb = functions(qt)
    _, g = mx.vjp(ours, [x, *sb], [dy])
    perm = np.asarray(qt.perm)
    X, DY = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    W = np.asarray(qt.dequantize(unpermute=True), np.float64)
    np.testing.assert_allclose(np.asarray(g[0]), DY @ W, rtol=1e-4, atol=1e-4)
    G = DY.T @ X[:, perm]
    k0 = 0
    for i, s in enumerate(qt.segments):
        q = unpack_codes(np.asarray(s.wq), s.bits).astype(np.float64)
        Gs = G[:, k0:k0 + s.k].reshape(17, -1, s.group_size)
        qs = q.reshape(17, -1, s.group_size)
        np.testing.assert_allclose(np.asarray(g[1 + 2 * i]), (Gs * qs).sum(-1), rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(np.asarray(g[2 + 2 * i]), Gs.sum(-1), rtol=1e-4, atol=1e-3)
        k0 += s.k


def test_vmap_over_x():
    rng = np.random.default_rng(3)
    qt = make(rng, 11, [(4, 32, 64), (2, 64, 64)], mx.float32)
    x = rand(rng, (4, 3, 128), mx.float32)
    for axis in (0, 1):
        y = mx.vmap(lambda v: mixbits.qmatmul(v, qt), in_axes=axis)(x)
        ref = mixbits.qmatmul(mx.moveaxis(x, axis, 0), qt)
        np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-6, atol=1e-6)


def test_vmap_over_weights_refused():
    rng = np.random.default_rng(4)
    qt = make(rng, 8, [(4, 32, 64)], mx.float32, perm=False)
    s = qt.segments[0]
    x = rand(rng, (2, 64), mx.float32)
    scales = mx.stack([s.scales, s.scales])
    f = lambda sc: mixbits.qmatmul(x, QuantizedTensor([Segment(4, 32, 64, s.wq, sc, s.biases)]))
    with pytest.raises(RuntimeError, match="only x can be vmapped"):
        mx.eval(mx.vmap(f)(scales))


def mlx_weight_grad_error():
    """The exception type MLX raises for a gradient wrt packed weights."""
    wq, s, b = mx.quantize(mx.ones((8, 64)), group_size=32, bits=4)
    try:
        mx.grad(lambda w: mx.quantized_matmul(mx.ones((1, 64)), w, s, b, group_size=32, bits=4).sum())(wq)
    except Exception as e:  # noqa: BLE001 - we want its type
        return type(e)
    raise AssertionError("MLX gave a gradient wrt the quantized weights")


def test_no_gradient_wrt_packed_weights_or_perm():
    etype = mlx_weight_grad_error()
    rng = np.random.default_rng(8)
    qt = make(rng, 8, [(4, 32, 64)], mx.float32, perm=True)
    s = qt.segments[0]
    x = rand(rng, (2, 64), mx.float32)
    f = lambda w: mixbits.qmatmul(x, QuantizedTensor([Segment(4, 32, 64, w, s.scales, s.biases)], qt.perm)).sum()
    with pytest.raises(etype, match="quantized weights"):
        mx.grad(f)(s.wq)
    with pytest.raises(etype, match="quantized weights"):
        mx.jvp(f, [s.wq], [mx.zeros_like(s.wq)])


# ------------------------------------------------------------ the layer


def test_layer_bias_trainable_like_mlx():
    lin = nn.Linear(128, 16)
    stock = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4)
    ours = MixedQuantizedLinear.from_quantized(stock)
    assert set(stock.trainable_parameters()) == {"bias"}
    assert set(dict(nn.utils.tree_flatten(ours.trainable_parameters()))) == {"bias"}
    mixed = MixedQuantizedLinear.from_linear(lin, [(4, 64, 64), (3, 32, 64)], perm=np.arange(128)[::-1])
    assert set(dict(nn.utils.tree_flatten(mixed.trainable_parameters()))) == {"bias"}
    # Built from shapes: everything frozen, as nn.QuantizedLinear(…) is.
    assert not nn.utils.tree_flatten(nn.QuantizedLinear(128, 16).trainable_parameters())
    assert not nn.utils.tree_flatten(MixedQuantizedLinear(128, 16).trainable_parameters())
    # A frozen bias stays frozen through from_quantized.
    stock.freeze()
    assert not nn.utils.tree_flatten(MixedQuantizedLinear.from_quantized(stock).trainable_parameters())


def float_twin(layer):
    """nn.Linear with the layer's dequantized weight (original column order)."""
    lin = nn.Linear(layer.input_dims, layer.output_dims)
    lin.weight = layer.quantized_tensor().dequantize(unpermute=True)
    lin.bias = layer.bias
    return lin


def test_training_step_value_and_grad():
    rng = np.random.default_rng(11)
    lin = nn.Linear(192, 24)
    layer = MixedQuantizedLinear.from_linear(lin, [(4, 64, 128), (2, 32, 64)], perm=rng.permutation(192))
    x, target = rand(rng, (8, 192), mx.float32), rand(rng, (8, 24), mx.float32)
    loss = lambda model, x, t: ((model(x) - t) ** 2).mean()
    val, grads = nn.value_and_grad(layer, loss)(layer, x, target)
    twin = float_twin(layer)
    rval, rgrads = nn.value_and_grad(twin, loss)(twin, x, target)
    np.testing.assert_allclose(val.item(), rval.item(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["bias"]), np.asarray(rgrads["bias"]), rtol=1e-5, atol=1e-6)
    opt = optim.SGD(learning_rate=0.1)
    before = layer.bias
    for _ in range(5):
        val2, grads = nn.value_and_grad(layer, loss)(layer, x, target)
        opt.update(layer, grads)
        mx.eval(layer.parameters())
    assert not np.array_equal(np.asarray(before), np.asarray(layer.bias))
    assert loss(layer, x, target).item() < val.item()


def test_scale_tuning_step_single_segment():
    """DWQ-style: unfreeze scales/biases as on nn.QuantizedLinear, and the
    gradients match the stock layer's."""
    rng = np.random.default_rng(12)
    lin = nn.Linear(128, 16)
    stock = nn.QuantizedLinear.from_linear(lin, group_size=32, bits=3)
    ours = MixedQuantizedLinear.from_quantized(stock)
    for m in (stock, ours):
        m.unfreeze(keys=["scales", "biases"], recurse=False)
    x, t = rand(rng, (4, 128), mx.float32), rand(rng, (4, 16), mx.float32)
    loss = lambda model, x, t: ((model(x) - t) ** 2).sum()
    _, g_o = nn.value_and_grad(ours, loss)(ours, x, t)
    _, g_s = nn.value_and_grad(stock, loss)(stock, x, t)
    assert set(g_o) == set(g_s) == {"scales", "biases", "bias"}
    for k in g_s:
        close(g_o[k], g_s[k], mx.float32, k)
    opt = optim.Adam(learning_rate=1e-2)
    l0 = loss(ours, x, t).item()
    for _ in range(5):
        _, g = nn.value_and_grad(ours, loss)(ours, x, t)
        opt.update(ours, g)
        mx.eval(ours.parameters())
    assert loss(ours, x, t).item() < l0


def test_grad_vjp_jvp_through_layer_input():
    rng = np.random.default_rng(13)
    layer = MixedQuantizedLinear.from_linear(nn.Linear(96, 12), [(5, 32, 64), (8, 32, 32)],
                                             perm=rng.permutation(96))
    twin = float_twin(layer)
    x = rand(rng, (3, 96), mx.float32)
    f, fr = (lambda v: (layer(v) ** 2).sum()), (lambda v: (twin(v) ** 2).sum())
    np.testing.assert_allclose(np.asarray(mx.grad(f)(x)), np.asarray(mx.grad(fr)(x)), rtol=1e-4, atol=1e-4)
    ct = rand(rng, (3, 12), mx.float32)
    _, (vo,) = mx.vjp(layer, [x], [ct])
    _, (vr,) = mx.vjp(twin, [x], [ct])
    np.testing.assert_allclose(np.asarray(vo), np.asarray(vr), rtol=1e-4, atol=1e-4)
    t = rand(rng, (3, 96), mx.float32)
    _, (jo,) = mx.jvp(layer, [x], [t])
    _, (jr,) = mx.jvp(twin, [x], [t])
    np.testing.assert_allclose(np.asarray(jo), np.asarray(jr), rtol=1e-4, atol=1e-4)
