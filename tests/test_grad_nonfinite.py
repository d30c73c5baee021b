"""The gradient proxy on a model whose backward is not finite: mlx-lm's
RG-LRU (recurrent_gemma) takes sqrt(1 - a^2), whose derivative is infinite
at a^2 = 1, and every tensor upstream of it gets a NaN Fisher diagonal.
Those tensors are named, measured exactly instead, and the table holds no
NaN; the others keep their proxy values."""

from __future__ import annotations

import json
import math
import warnings

import mlx.core as mx
import numpy as np
import pytest

from mixbits.adapter import ModelAdapter
from mixbits.measure.candidates import parse_candidate
from mixbits.measure.grad import ProxyFallbackWarning, fisher_diagonal
from mixbits.measure.replay import Replayer, token_chunks
from mixbits.measure.sweep import SweepConfig, measure_site

CANDS = ["2b_g32", "4b_g64"]


def _saturated_recurrent_gemma(seed=0):
    """A tiny recurrent_gemma whose second recurrent block has a = 1
    (softplus of its recurrent parameter underflows to 0, so log a = 0)."""
    from mlx_lm.utils import _get_classes

    cfg = dict(model_type="recurrent_gemma", attention_bias=False, conv1d_width=4, hidden_size=64,
               intermediate_size=128, logits_soft_cap=30.0, num_attention_heads=4,
               num_hidden_layers=3, num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=10000.0,
               attention_window_size=16, vocab_size=160,
               block_types=["recurrent", "recurrent", "attention"])
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    lru = ModelAdapter(model).blocks[1].temporal_block.rg_lru
    lru.recurrent_param = mx.full(lru.recurrent_param.shape, -200.0)
    model.eval()
    mx.eval(model.parameters())
    return model


def _tokens():
    return np.random.default_rng(0).integers(0, 160, (2, 12))


def test_nonfinite_fisher_tensors_are_measured_exactly(tmp_path):
    from mixbits.measure.two_stage import proxy_sweep

    model = _saturated_recurrent_gemma()
    toks = _tokens()
    ad = ModelAdapter(model)
    fisher, _ = fisher_diagonal(model, toks, ad.sites, progress=False)
    bad = [s.path for s in ad.sites if not np.isfinite(fisher[s.path]).all()]
    assert bad and len(bad) < len(ad.sites)  # upstream of block 1 only

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        table = proxy_sweep(model, toks, tmp_path / "g.json", CANDS, method="grad", progress=False)
    ours = [w for w in seen if issubclass(w.category, ProxyFallbackWarning)]
    assert len(ours) == 1 and bad[0] in str(ours[0].message)
    json.loads((tmp_path / "g.json").read_text())  # written, strict JSON
    by_path = {e["path"]: e for e in table["entries"]}
    assert [e["path"] for e in table["entries"]] == [s.path for s in ad.sites]
    assert sorted(p for p, e in by_path.items() if "proxy_fallback" in e) == sorted(bad)
    rp = Replayer(model, token_chunks(toks, 4), ad)
    cands = [parse_candidate(c) for c in CANDS]
    for s in ad.sites:
        e = by_path[s.path]
        assert all(math.isfinite(c["kl"]) for c in e["candidates"])
        if s.path in bad:
            assert "not finite" in e["proxy_fallback"]
            assert {c["source"] for c in e["candidates"]} == {"exact"}
            want = measure_site(rp, s, cands, SweepConfig(CANDS)).kl
            for c in e["candidates"]:
                assert c["kl"] == pytest.approx(want[c["kind"]], rel=1e-6, abs=1e-12)
        else:
            assert {c["source"] for c in e["candidates"]} == {"grad"}


def test_two_stage_keeps_the_fallback_exact(tmp_path):
    from mixbits.measure.two_stage import proxy_sweep

    model = _saturated_recurrent_gemma()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProxyFallbackWarning)
        grad = proxy_sweep(model, _tokens(), tmp_path / "g.json", CANDS, method="grad",
                           progress=False)
        two = proxy_sweep(model, _tokens(), tmp_path / "t.json", CANDS, method="two-stage",
                          targets=(3.0,), budget=0.3, rounds=1, progress=False)
    # The scales come from the proxy pairs measured exactly, not from the
    # fallback's (exact on both sides, they would pull every scale to 1).
    assert two["meta"]["exact_pairs"] > 0 and two["meta"]["proxy_scale_overall"] != 1.0
    g = {e["path"]: e for e in grad["entries"] if "proxy_fallback" in e}
    t = {e["path"]: e for e in two["entries"]}
    for p, e in g.items():  # not rescaled as proxy values would be
        assert [c["kl"] for c in t[p]["candidates"]] == [c["kl"] for c in e["candidates"]]
        assert {c["source"] for c in t[p]["candidates"]} == {"exact"}
