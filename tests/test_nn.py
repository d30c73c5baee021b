"""mixbits.nn layers on small random weights, checked against MLX's own
quantize/dequantize and numpy float64 matmuls (independent of mixbits'
quantizer and kernel)."""

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

import mixbits
from mixbits.nn import MixedQuantizedEmbedding, MixedQuantizedLinear


def _np(a):
    return np.array(a.astype(mx.float32), dtype=np.float64)


def _ref_dequant(w: np.ndarray, segments, perm=None, dtype=mx.float32) -> np.ndarray:
    """Dense W' in stored column order, built segment by segment with
    mx.quantize/mx.dequantize, ternary in numpy."""
    if perm is not None:
        w = w[:, perm]
    parts, k0 = [], 0
    for bits, gs, k in segments:
        part = w[:, k0:k0 + k]
        if bits == "ternary":
            g = part.reshape(part.shape[0], -1, gs)
            s = np.abs(g).mean(-1, keepdims=True)
            s = np.array(mx.array(s.astype(np.float32)).astype(dtype).astype(mx.float32), dtype=np.float64)
            parts.append((np.clip(np.rint(g / np.where(s > 0, s, 1)), -1, 1) * s).reshape(part.shape))
        else:
            q = mx.quantize(mx.array(part.astype(np.float32)).astype(dtype), group_size=gs, bits=bits)
            parts.append(_np(mx.dequantize(*q, group_size=gs, bits=bits)))
        k0 += k
    return np.concatenate(parts, axis=1)


def _close(y, ref, tol=2e-3):
    y = _np(y)
    scale = max(np.abs(ref).max(), 1e-6)
    assert y.shape == ref.shape
    err = np.abs(y - ref).max() / scale
    assert err < tol, f"max relative error {err:.2e} >= {tol}"


SEGMENTS = [
    [(4, 64, 256)],
    [(8, 32, 64), (4, 64, 128), (3, 32, 64)],
    [(6, 128, 128), ("ternary", 32, 64), (2, 64, 64)],
]


@pytest.mark.parametrize("segments", SEGMENTS, ids=["one", "three", "ternary"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("use_perm", [False, True])
def test_from_linear_matches_reference(segments, bias, use_perm):
    mx.random.seed(1)
    lin = nn.Linear(256, 96, bias=bias)
    w = _np(lin.weight)
    perm = np.random.default_rng(0).permutation(256).astype(np.int32) if use_perm else None
    layer = MixedQuantizedLinear.from_linear(lin, segments, perm=perm)
    x = mx.random.normal((2, 3, 256))  # 3-D input
    wd = _ref_dequant(w, segments, perm)
    xn = _np(x)
    if perm is not None:
        xn = xn[..., perm]
    ref = xn @ wd.T + (_np(lin.bias) if bias else 0.0)
    _close(layer(x), ref)
    # Parameters are MLX arrays in the module tree, named as documented.
    names = {k for k, _ in tree_flatten(layer.parameters())}
    if len(segments) == 1 and perm is None:
        assert {"weight", "scales", "biases"} <= names
    else:
        assert {f"segments.{i}.{n}" for i in range(len(segments)) for n in ("weight", "scales", "biases")} <= names
        assert ("perm" in names) == use_perm
    assert ("bias" in names) == bias


def test_bits_per_weight_as_specified():
    lin = nn.Linear(256, 64, bias=False)
    layer = MixedQuantizedLinear.from_linear(lin, [(4, 64, 128), ("ternary", 32, 128)], dtype=mx.float16)
    # fp16 scale + bias per group: bits + 32/group_size
    expected = (128 * (4 + 32 / 64) + 128 * (2 + 32 / 32)) / 256
    assert layer.bits_per_weight == pytest.approx(expected)


@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 32), (3, 128), (2, 32)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_dtype", [mx.float32, mx.float16])
def test_from_quantized_equals_quantized_linear(bits, gs, bias, x_dtype):
    mx.random.seed(2)
    ql = nn.QuantizedLinear.from_linear(nn.Linear(256, 80, bias=bias), gs, bits)
    layer = MixedQuantizedLinear.from_quantized(ql)
    # same arrays, no re-quantization
    assert layer["weight"] is ql["weight"] and layer["scales"] is ql["scales"]
    x = mx.random.normal((4, 5, 256)).astype(x_dtype)
    w = _np(mx.dequantize(ql.weight, ql.scales, ql.biases, group_size=gs, bits=bits))
    ref = _np(x) @ w.T + (_np(ql.bias) if bias else 0.0)
    y = layer(x)
    assert y.dtype == ql(x).dtype  # x's dtype, promoted by a float32 bias as in MLX
    _close(y, ref, tol=5e-3 if x_dtype == mx.float16 else 2e-4)
    _close(y, _np(ql(x)), tol=5e-3 if x_dtype == mx.float16 else 2e-4)


def test_from_quantized_rejects_non_affine():
    ql = nn.QuantizedLinear(64, 32, mode="mxfp4")
    with pytest.raises(ValueError, match="affine"):
        MixedQuantizedLinear.from_quantized(ql)
    with pytest.raises(TypeError, match="QuantizedLinear"):
        MixedQuantizedLinear.from_quantized(nn.Linear(64, 32))


def test_shape_constructor_load_weights_and_cache():
    src = MixedQuantizedLinear.from_linear(nn.Linear(256, 48), [(4, 64, 128), (8, 32, 128)], perm=np.arange(256)[::-1].copy())
    dst = MixedQuantizedLinear(256, 48, bias=True, segments=[(4, 64, 128), (8, 32, 128)], perm=True, dtype=mx.float32)
    x = mx.random.normal((3, 256))
    before = dst(x)  # builds the cached tensor from the placeholders
    dst.load_weights(list(tree_flatten(src.parameters())))
    after = dst(x)
    assert mx.array_equal(after, src(x)).item()
    assert not mx.allclose(before, after).item()


def test_save_and_load_weights_roundtrip(tmp_path):
    layer = MixedQuantizedLinear.from_linear(nn.Linear(128, 32), [(4, 64, 64), (2, 32, 64)])
    layer.save_weights(str(tmp_path / "w.safetensors"))
    other = MixedQuantizedLinear(128, 32, bias=True, segments=[(4, 64, 64), (2, 32, 64)], dtype=mx.float32)
    other.load_weights(str(tmp_path / "w.safetensors"))
    x = mx.random.normal((2, 128))
    assert mx.array_equal(layer(x), other(x)).item()


def test_bad_segments_are_rejected():
    lin = nn.Linear(256, 32)
    with pytest.raises(ValueError, match="sum to"):
        MixedQuantizedLinear.from_linear(lin, [(4, 64, 128)])
    with pytest.raises(ValueError, match="multiple of group_size"):
        MixedQuantizedLinear.from_linear(lin, [(4, 64, 96), (4, 32, 160)])
    with pytest.raises(ValueError, match="bits"):
        MixedQuantizedLinear.from_linear(lin, [(7, 64, 256)])
    layer = MixedQuantizedLinear.from_linear(lin, [(4, 64, 256)])
    with pytest.raises(ValueError, match="K=256"):
        layer(mx.zeros((2, 128)))


# ---------------------------------------------------------------- embeddings


def test_embedding_from_quantized_lookup_and_as_linear():
    mx.random.seed(3)
    qe = nn.QuantizedEmbedding.from_embedding(nn.Embedding(500, 128), 32, 8)
    e = MixedQuantizedEmbedding.from_quantized(qe)
    ids = mx.array([[0, 7, 499], [3, 3, 250]])
    assert mx.array_equal(e(ids), qe(ids)).item()
    x = mx.random.normal((2, 3, 128))
    w = _np(mx.dequantize(qe.weight, qe.scales, qe.biases, group_size=32, bits=8))
    _close(e.as_linear(x), _np(x) @ w.T, tol=2e-4)


def test_mixed_embedding_with_perm():
    mx.random.seed(4)
    emb = nn.Embedding(64, 128)
    perm = np.random.default_rng(1).permutation(128).astype(np.int32)
    segs = [(8, 32, 64), (4, 64, 64)]
    e = MixedQuantizedEmbedding.from_embedding(emb, segs, perm=perm)
    wd = _ref_dequant(_np(emb.weight), segs, perm)  # stored (permuted) order
    rows = np.empty_like(wd)
    rows[:, perm] = wd  # back to original column order
    ids = mx.array([5, 0, 63])
    _close(e(ids), rows[[5, 0, 63]], tol=1e-5)
    x = mx.random.normal((4, 128))
    _close(e.as_linear(x), _np(x)[:, perm] @ wd.T)


# ---------------------------------------------------------------- model level


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 2 * d, bias=True)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.norm = nn.RMSNorm(d)

    def __call__(self, h):
        return h + self.down(nn.silu(self.up(self.norm(h))))


class _Tiny(nn.Module):
    """Embedding, a list of blocks, tied head: the shape of an LLM."""

    def __init__(self, vocab=256, d=128, n=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = [_Block(d) for _ in range(n)]

    def __call__(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.embed.as_linear(h)


def _quantized_tiny(mode="affine"):
    mx.random.seed(5)
    m = _Tiny()
    nn.quantize(m, group_size=64 if mode == "affine" else None, bits=None, mode=mode)
    mx.eval(m.parameters())
    return m


def test_patch_same_outputs_and_paths():
    m = _quantized_tiny()
    ids = mx.array([[1, 2, 3, 200]])
    ref = m(ids)
    before = dict(tree_flatten(m.parameters()))
    paths = mixbits.patch(m)
    assert sorted(paths) == sorted(
        ["embed"] + [f"layers.{i}.{p}" for i in range(2) for p in ("up", "down")]
    )
    assert isinstance(m.layers[1].down, MixedQuantizedLinear)
    assert isinstance(m.embed, MixedQuantizedEmbedding)
    after = dict(tree_flatten(m.parameters()))
    assert before.keys() == after.keys()
    assert all(before[k] is after[k] for k in before)  # nothing re-quantized or copied
    _close(m(ids), _np(ref), tol=1e-4)
    assert mixbits.patch(m) == []  # nothing left to replace


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4", "mxfp8"])
def test_patch_leaves_non_affine_to_mlx(mode):
    """MLX's fp modes have no mixbits kernel: patch leaves those layers to
    MLX (strict or not) and the model computes what it did."""
    m = _quantized_tiny(mode=mode)
    ids = mx.array([[1, 2, 3, 200]])
    ref = m(ids)
    assert mixbits.patch(m) == []
    assert mixbits.patch(m, strict=False) == []
    assert type(m.layers[0].up) is nn.QuantizedLinear and m.layers[0].up.mode == mode
    assert type(m.embed) is nn.QuantizedEmbedding
    _close(m(ids), _np(ref), tol=1e-4)  # the norms now run mixbits' kernel


def test_quantize_model_changes_exactly_the_assigned_tensors():
    mx.random.seed(6)
    m = _Tiny()
    mx.eval(m.parameters())
    before = dict(tree_flatten(m.parameters()))
    assignment = {
        "layers.0.up": [(8, 32, 64), (3, 64, 64)],
        "layers.1.down": {"bits": 2, "group_size": 32},
        "layers.1.up": "ternary",
        "embed": (8, 64),
    }
    replaced = mixbits.quantize_model(m, assignment, dtype=mx.float16)  # fp16 scales and biases
    assert sorted(replaced) == sorted(assignment)
    after = dict(tree_flatten(m.parameters()))
    touched = {k for k in after if any(k.startswith(p + ".") for p in assignment)}
    for k in after:
        if k not in touched:
            assert after[k] is before[k], k
    assert isinstance(m.layers[0].down, nn.Linear)  # not assigned, still float
    assert m.layers[0].up.bits_per_weight == pytest.approx((64 * (8 + 32 / 32) + 64 * (3 + 32 / 64)) / 128)
    assert m.layers[1].down.bits_per_weight == pytest.approx(2 + 32 / 32)
    assert m.layers[1].up.bits_per_weight == pytest.approx(2 + 32 / 64)
    assert m.layers[1].up.layout.kinds == ("ternary",)
    assert m.embed.bits_per_weight == pytest.approx(8 + 32 / 64)
    # the float bias of up survives; outputs stay close to the float model
    assert m.layers[0].up["bias"] is before["layers.0.up.bias"]


def test_quantize_model_bad_input_changes_nothing():
    m = _Tiny()
    mx.eval(m.parameters())
    with pytest.raises(KeyError, match="layers.9.up"):
        mixbits.quantize_model(m, {"layers.0.up": 4, "layers.9.up": 4})
    assert isinstance(m.layers[0].up, nn.Linear)
    with pytest.raises(ValueError, match=r"layers\.0\.down.*sum to"):
        mixbits.quantize_model(m, {"layers.0.down": [(4, 64, 128)]})  # K = 256
    with pytest.raises(ValueError, match=r"layers\.0\.up.*multiple of group_size"):
        mixbits.quantize_model(m, {"layers.0.up": [(4, 64, 96), (4, 32, 32)]})
    with pytest.raises(ValueError, match="group_size"):
        mixbits.quantize_model(m, {"layers.0.up": {"bits": 4, "group_size": 48}})
    with pytest.raises(TypeError, match="RMSNorm"):
        mixbits.quantize_model(m, {"layers.0.norm": 4})
    with pytest.raises(ValueError, match="assignment"):
        mixbits.quantize_model(m, {"layers.0.up": True})
    assert isinstance(m.layers[0].up, nn.Linear) and isinstance(m.layers[0].down, nn.Linear)


def test_save_load_tiny_mixed_folder_params(tmp_path):
    """The mixbits section of config.json describes every mixbits layer."""
    from mixbits.io import quantization_config

    m = _quantized_tiny()
    mixbits.quantize_model(m, {"layers.0.up": [(8, 32, 64), (4, 64, 64)], "layers.1.down": 3})
    quant, layers = quantization_config(m)
    block = quant.to_block()
    assert block["layers.1.down"] == {"group_size": 64, "bits": 3}
    assert "layers.0.up" not in block  # two segments: not an MLX affine layer
    assert layers["layers.0.up"]["segments"] == [[8, 32, 64], [4, 64, 64]]
    assert block["layers.0.down"] == {"group_size": 64, "bits": 4}  # stock layer kept
