"""Replay finds each block's batch axis instead of assuming axis 0, and
falls back to the full forward, with a warning, whenever its check fails
for any reason.

gemma3n's blocks carry the AltUp streams stacked as [4, batch, T, D]: the
replay must tile the recorded outputs and slice the candidates' inputs
along axis 1 (before: `[matmul] Last dimension ... must match` from the
check that should have caught it)."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

from mixbits.adapter import ModelAdapter
from mixbits.measure.candidates import parse_candidate, supports
from mixbits.measure.replay import Replayer, batch_axis, token_chunks
from mixbits.measure.sweep import SweepConfig, measure_site
from test_any_model import direct_kl

CANDS = ["2b_g32", "ternary_g64", "3b16_2b_g32"]


def _gemma3n(seed=0):
    from mlx_lm.utils import _get_classes

    text = dict(model_type="gemma3n_text", hidden_size=64, num_hidden_layers=4,
                intermediate_size=128, num_attention_heads=4, head_dim=16, rms_norm_eps=1e-6,
                vocab_size=160, num_key_value_heads=2, num_kv_shared_layers=2,
                vocab_size_per_layer_input=160, sliding_window=8, max_position_embeddings=512,
                rope_local_base_freq=10000.0, rope_theta=1000000.0, final_logit_softcapping=30.0,
                layer_types=["sliding_attention", "full_attention"] * 2,
                activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0],
                hidden_size_per_layer_input=16, altup_num_inputs=4, altup_coef_clip=120.0,
                altup_correct_scale=True, altup_active_idx=0, laurel_rank=32)
    cfg = dict(model_type="gemma3n", text_config=text)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    # mlx-lm initializes some of these to zero (AltUp's output scale):
    # perturb every float parameter so every tensor matters.
    from mlx.utils import tree_flatten

    key = mx.random.key(seed + 1)
    params = tree_flatten(model.parameters())
    keys = mx.random.split(key, len(params))
    model.load_weights([(k, v + 0.02 * mx.random.normal(v.shape, key=keys[i]))
                        for i, (k, v) in enumerate(params)])
    model.eval()
    mx.eval(model.parameters())
    return model


def _tokens(n, seq=24, seed=0):
    return np.random.default_rng(seed).integers(0, 160, (n, seq))


def test_batch_axis():
    assert batch_axis(mx.zeros((4, 2, 24, 8)), 2, 24) == 1
    assert batch_axis(mx.zeros((2, 24, 8)), 2, 24) == 0
    assert batch_axis(mx.zeros((4, 4, 4, 8)), 4, 4) is None  # ambiguous
    assert batch_axis(mx.zeros((24, 2, 8)), 2, 24) is None  # sequence first: none
    assert batch_axis(None, 2, 24) is None


@pytest.mark.parametrize("n_seq", [1, 2])
def test_gemma3n_replays_along_its_batch_axis(n_seq):
    model = _gemma3n()
    adapter = ModelAdapter(model)
    toks = _tokens(n_seq)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn: fail instead
        rp = Replayer(model, token_chunks(toks, n_seq), adapter)
    assert rp.replayable and rp.axes[0][0] == (1, 1)  # [4, batch, T, D] in and out
    ref = model(mx.array(toks))
    np.testing.assert_array_equal(np.array(rp.logits[0]), np.array(ref.astype(mx.float32)))
    cands = [parse_candidate(c) for c in CANDS]
    picked = {}
    for s in adapter.sites:  # one tensor of every block child, and the outside ones
        key = s.path if s.block is None else adapter.local_path(s).split(".")[0]
        if any(supports(c, s) for c in cands) and (s.block is None or s.block in (0, 3)):
            picked.setdefault((s.block, key), s)
    assert len(picked) > 10
    for site in picked.values():
        cs = [c for c in cands if supports(c, site)]
        res = measure_site(rp, site, cs, SweepConfig([c.name for c in cs], max_batch=8))
        for c in cs:
            direct = direct_kl(model, adapter, site, c, toks, ref)
            assert direct > 0, (site.path, c.name)
            assert res.kl[c.name] == pytest.approx(direct, rel=1e-4), (site.path, c.name)


def test_failing_check_falls_back_with_warning(monkeypatch):
    """Whatever goes wrong in the replay check (here: it raises), the
    Replayer warns and measures with the full forward."""
    import tiny_models

    model, _ = tiny_models.build("llama")
    toks = _tokens(2)

    def broken(self, *a, **k):
        raise ValueError("[matmul] shapes do not match")

    monkeypatch.setattr(Replayer, "candidate_logits", broken)
    with pytest.warns(RuntimeWarning, match="full forward"):
        rp = Replayer(model, token_chunks(toks, 2))
    assert not rp.replayable and "matmul" in rp.reason
    monkeypatch.undo()
    adapter = rp.adapter
    site = next(s for s in adapter.sites if s.block == 1)
    c = parse_candidate("2b_g32")
    res = measure_site(rp, site, [c], SweepConfig([c.name]))
    ref = model(mx.array(toks))
    assert res.kl[c.name] == pytest.approx(direct_kl(model, adapter, site, c, toks, ref), rel=1e-6)


def test_hidden_state_without_batch_axis_falls_back():
    """Blocks fed [T, batch, D] (sequence first): no batch axis found, so
    the full forward, with the warning, and the right KL."""
    import mlx.nn as nn
    import tiny_models

    model, _ = tiny_models.build("llama")
    inner = model.model

    class SequenceFirst(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def __call__(self, h, mask=None, cache=None):
            return self.block(h.swapaxes(0, 1), mask, cache).swapaxes(0, 1)

    class Model(type(inner)):
        def __call__(self, inputs, cache=None, input_embeddings=None):
            h = self.embed_tokens(inputs).swapaxes(0, 1)
            for layer in self.layers:
                h = layer(h, "causal")
            return self.norm(h.swapaxes(0, 1))

    inner.layers = [SequenceFirst(b) for b in inner.layers]
    inner.__class__ = Model
    toks = _tokens(2)
    with pytest.warns(RuntimeWarning, match="full forward"):
        rp = Replayer(model, token_chunks(toks, 2))
    assert not rp.replayable and "batch axis" in rp.reason
    adapter = rp.adapter
    site = next(s for s in adapter.sites if s.block == 1)
    c = parse_candidate("2b_g32")
    res = measure_site(rp, site, [c], SweepConfig([c.name]))
    ref = model(mx.array(toks))
    assert res.kl[c.name] == pytest.approx(direct_kl(model, adapter, site, c, toks, ref), rel=1e-6)
