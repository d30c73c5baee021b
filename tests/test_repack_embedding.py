"""Repacked embeddings (a tied output head's table in the row-interleaved
layout, python/mixbits/repack.py): lookups read their rows from the 16-row
blocks and must equal MLX's own nn.QuantizedEmbedding bit for bit; the head
(``as_linear``) runs the repacked kernels under the int8/int16 contract;
patch / unrepack / save treat the embedding like a linear layer."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mixbits
from mixbits.errors import UsageError
from mixbits.nn import MixedQuantizedEmbedding
from mixbits.repack import REPACK_BITS, gather_rows
from mixbits import ops
from int_contract import rand_qt
from test_repack import check_contract, raw


def stock_embedding(rng, n, dims, bits, gs, dtype):
    emb = nn.Embedding(n, dims)
    emb.weight = mx.array(rng.standard_normal((n, dims)).astype(np.float32)).astype(dtype)
    return nn.QuantizedEmbedding.from_embedding(emb, group_size=gs, bits=bits)


def ids_for(rng, n, shape):
    """Random ids with the first and last rows (the padded block's) present."""
    ids = rng.integers(0, n, shape)
    ids.flat[0], ids.flat[-1] = 0, n - 1
    return mx.array(ids.astype(np.int32))


@pytest.mark.parametrize("bits", REPACK_BITS)
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_lookup_equals_mlx_embedding(bits, gs, dtype):
    rng = np.random.default_rng(bits * 100 + gs)
    for n in (37, 64):  # a padded tail block; whole blocks
        stock = stock_embedding(rng, n, 256, bits, gs, dtype)
        emb = MixedQuantizedEmbedding.from_quantized(stock)
        emb.repack()
        assert emb.is_repacked and "weight" not in emb and emb.num_embeddings == n and emb.dims == 256
        for shape in ((1, 1), (3, 7), (50,)):
            ids = ids_for(rng, n, shape)
            out, ref = emb(ids), stock(ids)
            assert out.shape == ref.shape and out.dtype == ref.dtype
            np.testing.assert_array_equal(raw(out), raw(ref))


def test_gather_rows_is_the_original_rows_and_compiles():
    """Every row of every block, incl. 3-bit chunks (whose words the layout
    rewrote), bit for bit; and the same under mx.compile (a decode step)."""
    rng = np.random.default_rng(5)
    qt = rand_qt(rng, 45, [(3, 32, 96), (8, 64, 64), (2, 128, 128), (4, 32, 64)], dtype=mx.bfloat16)
    rt = ops.repack(qt)
    ids = mx.arange(45, dtype=mx.int32).reshape(5, 9)
    compiled = mx.compile(lambda i: [a for s in rt.segments for a in gather_rows(s, i)])
    got_eager = [a for s in rt.segments for a in gather_rows(s, ids)]
    for got in (got_eager, compiled(ids)):
        want = [a[ids] for s in qt.segments for a in (s.wq, s.scales, s.biases)]
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_array_equal(raw(g), raw(w))


def test_mixed_segments_with_perm():
    rng = np.random.default_rng(6)
    qt = rand_qt(rng, 50, [(4, 64, 128), (3, 32, 64), (8, 32, 64)], perm=True)
    emb = MixedQuantizedEmbedding.from_tensor(qt)
    ids = ids_for(rng, 50, (4, 6))
    before = np.array(emb(ids))
    emb.repack()
    np.testing.assert_array_equal(np.array(emb(ids)), before)
    emb.unrepack()
    for a, b in zip(emb.quantized_tensor().arrays(), qt.arrays()):
        np.testing.assert_array_equal(raw(a), raw(b))


@pytest.mark.parametrize("act", ["int8", "int16"])
def test_tied_head_runs_the_repacked_contract(act):
    rng = np.random.default_rng(7)
    stock = stock_embedding(rng, 70, 256, 8, 32, mx.float16)  # 8-bit g32: SmolLM2's head
    emb = MixedQuantizedEmbedding.from_quantized(stock)
    emb.activations = act
    qt = emb.quantized_tensor()
    emb.repack()
    x = mx.array(rng.standard_normal((1, 1, 256)).astype(np.float32))
    y = emb.as_linear(x)
    assert y.shape == (1, 1, 70)
    assert "RepackedQMatmul" in node_names(y)  # the repacked kernels, not a per-call un-repack
    check_contract(y, x, qt, act)


def node_names(y) -> str:
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        mx.export_to_dot(os.path.join(d, "g.dot"), y)
        return open(os.path.join(d, "g.dot")).read()


class TiedModel(nn.Module):
    def __init__(self, rng, vocab, dims, bits):
        super().__init__()
        self.embed = stock_embedding(rng, vocab, dims, bits, 64, mx.float16)
        lin = nn.Linear(dims, dims)
        lin.weight = mx.array(rng.standard_normal((dims, dims)).astype(np.float32))
        self.proj = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4)

    def __call__(self, ids):
        return self.embed.as_linear(self.proj(self.embed(ids)))


def test_patch_repacks_the_tied_head(tmp_path):
    rng = np.random.default_rng(8)
    model = TiedModel(rng, 96, 128, 4)
    ids = ids_for(rng, 96, (1, 5))
    mixbits.patch(model, activations="int8", functions=False)
    ref = np.array(model(ids))
    stored = {p: raw(a) for p, a in mlx_flatten(model.parameters())}
    mixbits.nn.repack_layers(model)
    assert sorted(mixbits.nn.repacked_layers(model)) == ["embed", "proj"]
    # 96 rows, 128 outputs: no padding, the same bytes
    assert sum(a.nbytes for _, a in mlx_flatten(model.parameters())) == sum(a.nbytes for a in stored.values())
    out = np.array(model(ids))
    # The head's int8 contract on repacked vs original layout: float rounding.
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    with pytest.raises(UsageError, match="unrepack_layers"):
        mixbits.save(model, tmp_path / "m", config={"model_type": "x"})
    assert sorted(mixbits.nn.unrepack_layers(model)) == ["embed", "proj"]
    for p, a in mlx_flatten(model.parameters()):
        np.testing.assert_array_equal(raw(a), stored[p])


def test_embedding_with_unsupported_bits_stays_in_mlx_layout(monkeypatch):
    # Every width of mixbits.layout.BITS has a repacked layout now: a width
    # without one is simulated by taking 6 off the list the checks read.
    monkeypatch.setattr(mixbits.ops, "REPACK_BITS", (2, 3, 4, 5, 8))
    monkeypatch.setattr(mixbits.nn.model, "REPACK_BITS", (2, 3, 4, 5, 8))
    rng = np.random.default_rng(9)
    model = TiedModel(rng, 64, 128, 6)
    mixbits.patch(model, activations="int8", repack=True, functions=False)
    assert mixbits.nn.repacked_layers(model) == ["proj"]
    with pytest.raises(UsageError, match="no repacked layout"):
        model.embed.repack()
    assert not model.embed.is_repacked and "weight" in model.embed


def mlx_flatten(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)
