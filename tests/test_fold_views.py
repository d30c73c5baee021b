"""Views a node reads through (cpp/common/inputs.h, through_views).

A decode token reshapes q/k/v to heads and transposes them, and the
attention output back: on one token those views keep the elements in
row-major order, so rope, rms_norm and the quantized matmuls take the array
viewed and the view nodes leave the graph. Checked here: the results equal
the same node on a dense copy bit for bit and MLX's own ops to float
tolerance, on chains that keep the order (folded) and chains that do not
(prompt-shaped: left as they are); derivatives and vmap through a folded
node; a shapeless compile that would replay one on new shapes refused; and
the view nodes gone from a decode step's graph.
"""

from __future__ import annotations

import os
import re
import tempfile

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from mixbits import _ext, ops
from mixbits.norm import rms_norm
from mixbits.rope import rope

H, D = 3, 64  # heads, head dim: x's width K = 192
K = H * D


def nodes(*arrays) -> list[str]:
    """The primitive names in the graph of ``arrays``."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.dot")
        mx.export_to_dot(path, *arrays)
        text = open(path).read()
    return re.findall(r'\[label ="?([A-Za-z_]+)', text)


def dense(a: mx.array) -> mx.array:
    """An evaluated copy of a's values with no graph behind it."""
    return mx.array(np.array(a.astype(mx.float32))).astype(a.dtype)


def rand(shape, seed, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


# (name, root shape, views, whether the views keep the row-major order)
CHAINS = [
    ("heads", (2, 1, K), lambda a: a.reshape(2, 1, H, D).transpose(0, 2, 1, 3), True),
    ("heads_back", (2, H, 1, D), lambda a: a.transpose(0, 2, 1, 3).reshape(2, 1, H, D), True),
    ("expand_squeeze", (1, K), lambda a: mx.expand_dims(a, 0).squeeze(0).reshape(1, 1, H, D), True),
    ("flatten", (1, H, 1, D), lambda a: a.flatten(0, 2).reshape(1, H, 1, D).transpose(2, 0, 1, 3), True),
    # A prompt of 4 tokens: the transpose moves the token axis.
    ("prompt_heads", (1, 4, K), lambda a: a.reshape(1, 4, H, D).transpose(0, 2, 1, 3), False),
    # A root that is a strided view itself: read through its strides.
    ("strided_root", (H, 1, 1, D), lambda a: mx.swapaxes(a, 0, 3).reshape(D, H).T.reshape(1, H, 1, D), False),
]


VIEWS = {"Reshape", "Transpose", "ExpandDims", "Squeeze", "Flatten", "Unflatten"}


def folded(f, x) -> bool:
    """Whether f(x)'s graph has no more view nodes than f on a dense copy
    of x (the node's own, e.g. rope's offset reshaped, are in both)."""
    count = lambda y: sum(n in VIEWS for n in nodes(y))
    return count(f(x)) == count(f(dense(x)))


@pytest.mark.parametrize("name, shape, view, keeps", CHAINS, ids=[c[0] for c in CHAINS])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_rope_and_rms_norm_through_views(name, shape, view, keeps, dtype):
    mx.set_default_device(mx.cpu)
    root = rand(shape, 1, dtype)
    w = rand((view(root).shape[-1],), 2, dtype)
    off = mx.array(11, dtype=mx.int32)
    cases = [
        (lambda v: rope(v, D, offset=off),
         lambda v: mx.fast.rope(v, D, traditional=False, base=10000.0, scale=1.0, offset=11)),
        (lambda v: rms_norm(v, w, 1e-5), lambda v: mx.fast.rms_norm(v, w, 1e-5)),
    ]
    for ours, mlx in cases:
        x = view(root)  # anew: an evaluated view is a plain array, no longer a view node
        assert folded(ours, x) == keeps, (name, nodes(ours(x)))
        y = ours(x)
        assert y.shape == x.shape
        # Bit for bit the node on a dense copy of x (no view to read through).
        assert mx.array_equal(y, ours(dense(x))).item()
        ref = mlx(dense(x)).astype(mx.float32)
        tol = 1e-5 if dtype == mx.float32 else 2e-3
        np.testing.assert_allclose(np.array(y.astype(mx.float32)), np.array(ref), rtol=tol, atol=tol)


def quantized(seed, n=40):
    return mixbits.quantize(rand((n, K), seed), [(4, 32, 128), (8, 64, 64)])


# The matmul's x, shaped (..., K): as an attention output returns to o_proj.
X_CHAINS = [
    ("attn_out", (2, H, 1, D), lambda a: a.transpose(0, 2, 1, 3).reshape(2, 1, K), True),
    ("expand", (1, K), lambda a: mx.expand_dims(a, 0), True),
    ("heads_and_back", (2, 1, K), lambda a: a.reshape(2, 1, H, D).reshape(2, 1, K), True),
    ("prompt_out", (1, H, 4, D), lambda a: a.transpose(0, 2, 1, 3).reshape(1, 4, K), False),
    ("strided_root", (K, 2), lambda a: a.T.reshape(2, 1, K), False),
]


@pytest.mark.parametrize("name, shape, view, keeps", X_CHAINS, ids=[c[0] for c in X_CHAINS])
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_qmatmul_through_views(name, shape, view, keeps, activations):
    mx.set_default_device(mx.cpu)
    root = rand(shape, 3)
    x = view(root)
    qt = quantized(4)
    rq = ops.repack(qt)
    W = mx.concatenate([mx.dequantize(s.wq, s.scales, s.biases, group_size=s.group_size, bits=s.bits)
                        for s in qt.segments], axis=-1)
    ref = np.array(dense(x)) @ np.array(W).T
    calls = [lambda v, t=t: mixbits.qmatmul(v, t, activations=activations) for t in (qt, rq)]
    calls.append(lambda v: _ext.repacked_qmatmul_group(
        v, [(rq.arrays(), rq.specs, rq.shape[0])] * 2, 0, ops.activations_id(activations))[1])
    for f in calls:
        x = view(root)
        assert folded(f, x) == keeps, (name, nodes(f(x)))
        y = f(x)
        assert y.shape == x.shape[:-1] + (qt.shape[0],)
        assert mx.array_equal(y, f(dense(x))).item()
        tol = 2e-5 if activations == "float" else 3e-2
        np.testing.assert_allclose(np.array(y), ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_derivatives_through_a_folded_node():
    """vjp and jvp wrt the root of the views: MLX's own ops through the
    same views (which MLX differentiates itself)."""
    mx.set_default_device(mx.cpu)
    root = rand((2, 1, K), 5)
    heads = lambda a: a.reshape(2, 1, H, D).transpose(0, 2, 1, 3)
    w = rand((D,), 6)
    qt = quantized(7)
    W = mx.concatenate([mx.dequantize(s.wq, s.scales, s.biases, group_size=s.group_size, bits=s.bits)
                        for s in qt.segments], axis=-1)
    back = lambda h: h.transpose(0, 2, 1, 3).reshape(2, 1, K)
    pairs = [
        (lambda a: rope(heads(a), D, offset=mx.array(3)),
         lambda a: mx.fast.rope(heads(a), D, traditional=False, base=10000.0, scale=1.0, offset=3)),
        (lambda a: rms_norm(heads(a), w, 1e-5), lambda a: mx.fast.rms_norm(heads(a), w, 1e-5)),
        (lambda a: mixbits.qmatmul(back(heads(a)), qt), lambda a: back(heads(a)) @ W.T),
    ]
    for ours, mlx in pairs:
        assert "Transpose" not in nodes(ours(root))  # read through the views
        ct = rand(ours(root).shape, 8)
        tangent = rand(root.shape, 9)
        for got, want in ((mx.vjp(ours, [root], [ct]), mx.vjp(mlx, [root], [ct])),
                          (mx.jvp(ours, [root], [tangent]), mx.jvp(mlx, [root], [tangent]))):
            (g,), (r,) = got[1], want[1]
            assert g.shape == r.shape
            np.testing.assert_allclose(np.array(g), np.array(r), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("axis", [0, 1])
def test_vmap_over_a_folded_qmatmul(axis):
    mx.set_default_device(mx.cpu)
    qt = quantized(10)
    batch = rand((5, H, 1, D), 11) if axis == 0 else rand((H, 5, 1, D), 11)
    f = lambda h: mixbits.qmatmul(h.transpose(1, 0, 2).reshape(1, K), qt)
    y = mx.vmap(f, in_axes=axis)(batch)
    xs = mx.moveaxis(batch, axis, 0).transpose(0, 2, 1, 3).reshape(5, 1, K)
    np.testing.assert_array_equal(np.array(y), np.array(mixbits.qmatmul(dense(xs), qt)))


def test_int8_contract_kept_under_vmap():
    """vmap keeps the node's activations contract (it once fell back to float)."""
    mx.set_default_device(mx.cpu)
    qt = quantized(12)
    xs = rand((4, 1, K), 13)
    y = mx.vmap(lambda v: mixbits.qmatmul(v, qt, activations="int8"))(xs)
    np.testing.assert_array_equal(np.array(y), np.array(mixbits.qmatmul(xs, qt, activations="int8")))


def test_shapeless_compile_of_a_folded_node():
    """Same sizes replay; another size is refused by name, not mis-shaped."""
    mx.set_default_device(mx.cpu)
    f = mx.compile(lambda a: rope(a.reshape(a.shape[0], 1, H, D).transpose(0, 2, 1, 3), D,
                                  offset=mx.array(2)), shapeless=True)
    a = rand((1, 1, K), 14)
    want = rope(dense(a).reshape(1, 1, H, D).transpose(0, 2, 1, 3), D, offset=mx.array(2))
    assert mx.array_equal(f(a), want).item()
    b = rand((1, 1, K), 15)
    assert mx.array_equal(f(b), rope(dense(b).reshape(1, 1, H, D).transpose(0, 2, 1, 3), D,
                                     offset=mx.array(2))).item()
    with pytest.raises(ValueError, match="rope: .*shapeless"):
        mx.eval(f(rand((2, 1, K), 16)))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q_norm / k_norm before rope
def test_decode_step_has_no_view_nodes_around_attention(arch):
    """A patched tiny model's compiled decode step: per layer, q and k reach
    rope, v the cache write (kv_write) and the attention output o_proj, with
    no reshape or transpose node between; and the norms, SwiGLU and RoPE run
    inside their consumers (tests/test_inline_producers.py), so a layer is
    its matmuls, two cache writes, attention and two residual adds."""
    import mlx.nn as nn

    import tiny_models
    from mixbits.decode import Decoder

    mx.set_default_device(mx.cpu)
    model, cfg = tiny_models.build(arch, dtype=mx.float32)
    nn.quantize(model, group_size=32, bits=4)
    mixbits.patch(model, activations="int8", repack=True)
    d = Decoder(model)
    d.prefill([1, 2, 3, 4], capacity=16)
    mx.eval(d.step(5))  # traced (and checked against the plain forward)
    names = nodes(d.step(6))
    layers = len(model.model.layers)
    assert names.count("Transpose") == 0, names
    assert names.count("KvWrite") == 2 * layers, names
    for folded in ("Rope", "RmsNorm", "Swiglu"):
        assert names.count(folded) == 0, names
    # The step's own four, none per layer: the embedding lookup's two,
    # rope's offset and attention's kv_len.
    assert names.count("Reshape") <= 4, names
