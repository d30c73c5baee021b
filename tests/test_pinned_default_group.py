"""A model's quant_predicate may pin a layer with a dict lacking a group
size (rwkv7: ``{"bits": 8}`` for its LoRA outputs and embeddings);
``nn.quantize`` passes it to ``to_quantized``, where the missing group size
is MLX's default for the mode (64 for affine). mixbits must pin the same,
not a kind named ``8b_gNone`` that quantize cannot build; a pinned layer
whose width that group size does not divide stays float."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mixbits.adapter import ModelAdapter


def _rwkv7(seed=0):
    from mlx_lm.utils import _get_classes

    # v_low_rank_dim 32: v_lora's output layer reads K=32, which group 64
    # does not divide.
    cfg = dict(model_type="rwkv7", vocab_size=160, hidden_size=64, intermediate_size=128,
               norm_eps=1e-5, head_dim=16, num_hidden_layers=2, a_low_rank_dim=64,
               v_low_rank_dim=32, gate_low_rank_dim=64, decay_low_rank_dim=64,
               tie_word_embeddings=False)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    model.eval()
    mx.eval(model.parameters())
    return model, cfg


def test_pinned_dict_takes_mlx_default_group_size():
    model, _ = _rwkv7()
    ad = ModelAdapter(model)
    assert ad.fixed and all(spec == {"bits": 8, "group_size": 64} for spec in ad.fixed.values())
    assert "model.embeddings" in ad.fixed
    assert "model.layers.1.attn.v_lora.lora.2" in ad.excluded
    # What nn.quantize itself makes of the same dict: the group size we pin.
    layer = ad.get("model.layers.0.attn.a_lora.lora.2")
    assert layer.to_quantized(**model.quant_predicate("x.lora.2", layer)).group_size == 64


def test_pinned_layers_quantize_save_load(tmp_path):
    import mixbits
    from mixbits.commands.quantize import quantize_candidates

    model, cfg = _rwkv7()
    ad = ModelAdapter(model)
    toks = mx.array(np.random.default_rng(0).integers(0, 160, (2, 12)))
    replaced = quantize_candidates(model, {})  # the model's own pins only
    assert sorted(replaced) == sorted(ad.fixed)
    from mixbits.adapter import quantized_form

    for p in ad.fixed:
        segs = quantized_form(ModelAdapter(model).get(p)).segments
        assert [(s.bits, s.group_size) for s in segs] == [(8, 64)], p
    assert type(ModelAdapter(model).get("model.layers.1.attn.v_lora.lora.2")) is nn.Linear
    want = np.array(model(toks))
    mixbits.save(model, tmp_path / "out", cfg)
    loaded, _, _ = mixbits.load(tmp_path / "out")
    np.testing.assert_array_equal(np.array(loaded(toks)), want)
