"""``+search`` at tensors outside the blocks weighs its error by what they
multiply: an embedding the model also calls as its tied head gets the
X^T X of the head's input (the final norm's output, recorded around the
model's own ``as_linear`` call, never the token ids it looks up); a
separate head gets its input's; an embedding only looked up gets none and
keeps the plain squared error. References: the model's own forward up to
the head (``model.model``), X^T X in float64 numpy, and
``quantizers.search`` called directly."""

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from mixbits import quantizers
from mixbits.adapter import ModelAdapter, dense_weight
from mixbits.measure.candidates import build_layer, needs_inputs, parse_candidate
from mixbits.measure.replay import Replayer

SEARCH = parse_candidate("4b_g32+search")


def _setup(name):
    model, _ = tiny_models.build(name)
    ad = ModelAdapter(model)
    toks = np.random.default_rng(5).integers(0, 160, (4, 12))
    chunks = [mx.array(toks[:2]), mx.array(toks[2:])]
    return model, ad, chunks


def _head_input_xtx(model, chunks):
    """float64 X^T X of the head's input: the model's own body forward."""
    h = 0
    for c in chunks:
        x = np.array(model.model(c).astype(mx.float32), dtype=np.float64).reshape(-1, model.args.hidden_size)
        h = h + x.T @ x
    return h


def _site(ad, form, block=None):
    return next(s for s in ad.sites if s.form == form and s.block is block)


def _arrays(layer):
    from mlx.utils import tree_flatten

    return {k: np.array(v) for k, v in tree_flatten(layer.parameters())}


def _same_layer(a, b):
    ta, tb = _arrays(a), _arrays(b)
    return ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta)


def test_tied_embedding_is_weighted_by_the_head_input():
    model, ad, chunks = _setup("llama_tied")
    site = _site(ad, "embedding")
    assert needs_inputs(SEARCH, site)
    assert not needs_inputs(parse_candidate("4b_g32"), site)  # round-to-nearest takes none
    rp = Replayer(model, chunks, ad, logits=False)
    h, n = rp.input_hessian(site)
    ref = _head_input_xtx(model, chunks)
    assert n == sum(c.size for c in chunks)  # the head's rows, not one per looked-up id only by chance
    np.testing.assert_allclose(h, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    emb = ad.get(site.path)
    got = build_layer(emb, SEARCH, inputs=(h, n))
    w = dense_weight(emb)
    want = quantizers.search(w, SEARCH.segments(w.shape[-1]), dtype=mx.float16, h_diag=np.diag(ref))
    from mixbits.nn import MixedQuantizedEmbedding

    assert _same_layer(got, MixedQuantizedEmbedding.from_tensor(want))
    plain = quantizers.search(w, SEARCH.segments(w.shape[-1]), dtype=mx.float16)
    assert not _same_layer(got, MixedQuantizedEmbedding.from_tensor(plain))  # the weighting moved codes


def test_looked_up_embedding_and_separate_head():
    model, ad, chunks = _setup("llama")  # untied: lm_head is a linear outside the blocks
    rp = Replayer(model, chunks, ad, logits=False)
    emb_site = _site(ad, "embedding")
    assert needs_inputs(SEARCH, emb_site)
    h, n = rp.input_hessian(emb_site)
    assert h is None and n == 0  # only looked up
    emb = ad.get(emb_site.path)
    w = dense_weight(emb)
    from mixbits.nn import MixedQuantizedEmbedding

    plain = MixedQuantizedEmbedding.from_tensor(quantizers.search(w, SEARCH.segments(w.shape[-1]), dtype=mx.float16))
    assert _same_layer(build_layer(emb, SEARCH, inputs=(h, n)), plain)
    with pytest.raises(ValueError, match="no input"):
        build_layer(emb, parse_candidate("4b_g32+gptq"), inputs=(h, n))
    head = next(s for s in ad.sites if s.form == "linear" and s.block is None)
    assert needs_inputs(SEARCH, head)
    hh, nh = rp.input_hessian(head)
    ref = _head_input_xtx(model, chunks)
    assert nh == sum(c.size for c in chunks)
    np.testing.assert_allclose(hh, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
