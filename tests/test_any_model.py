"""The sweep runs the model's own forward on many mlx-lm architectures.

For every tiny random model in tests/tiny_models.py:
(a) the sweep's reference logits are ``model(tokens)``, and replay from a
    recorded prefix is possible (no silent fallback);
(b) for one tensor of every kind and module (attention, MLP, expert
    stacks, linear attention, MLA projections, embeddings, head), the
    sweep's KL equals the KL obtained by putting that candidate into the
    real model and calling ``model(tokens)``;
(c) measure -> allocate -> quantize -> save -> load gives the logits of
    the in-memory quantized model (and ``mlx_lm.load`` does too when every
    choice is a single MLX segment).
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from mixbits.adapter import ModelAdapter
from mixbits.measure.candidates import build_layer, parse_candidate, supports
from mixbits.measure.replay import Replayer
from mixbits.measure.sweep import SweepConfig, kl_per_token, measure_site, sweep

ARCHS = list(tiny_models.CONFIGS)
SEQ = 24  # longer than the sliding windows (8) of gemma3 / ministral3 / gpt_oss
CANDS = ["2b_g32", "ternary_g64", "3b16_2b_g32"]


def _tokens(n=2, seq=SEQ, seed=0):
    return np.random.default_rng(seed).integers(0, 160, (n, seq))


def _one_per_kind(adapter, cands=()):
    """One tensor per (form, block child) and each tensor outside blocks,
    among those some of ``cands`` fits (mamba's dt_proj, K=4, stays float)."""
    picked = {}
    for s in adapter.sites:
        if cands and not any(supports(c, s) for c in cands):
            continue
        key = (s.form, s.path) if s.block is None else (s.form, adapter.group_of(s).rsplit(".", 1)[-1])
        picked.setdefault(key, s)
    return list(picked.values())


def direct_kl(model, adapter, site, cand, toks, ref):
    """KL with the candidate placed in the real model, full model(tokens)."""
    orig = adapter.get(site.path)
    adapter.set(site.path, build_layer(orig, cand, mx.float16))
    try:
        kl = kl_per_token(ref, model(mx.array(toks)))
    finally:
        adapter.set(site.path, orig)
    return float(np.array(kl, dtype=np.float64).mean())


@pytest.mark.parametrize("arch", ARCHS)
def test_reference_is_model_and_sweep_kl_is_real_kl(arch):
    model, _ = tiny_models.build(arch)
    toks = _tokens()
    adapter = ModelAdapter(model)
    assert adapter.blocks and adapter.block_prefix.endswith("layers")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn: fail instead
        rp = Replayer(model, [mx.array(toks)], adapter)
    assert rp.replayable
    ref = model(mx.array(toks))
    np.testing.assert_array_equal(np.array(rp.logits[0]), np.array(ref.astype(mx.float32)))
    cands = [parse_candidate(c) for c in CANDS]
    kinds = set()
    for site in _one_per_kind(adapter, cands):
        cs = [c for c in cands if supports(c, site)]
        res = measure_site(rp, site, cs, SweepConfig([c.name for c in cs], max_batch=8))
        for c in cs:
            direct = direct_kl(model, adapter, site, c, toks, ref)
            assert direct > 0, (site.path, c.name)  # the candidate really changes the model
            assert res.kl[c.name] == pytest.approx(direct, rel=1e-4), (site.path, c.name)
        kinds.add(site.form if site.block is not None else "outside")
        if "linear_attn" in site.path:
            kinds.add("linear_attn")
    assert "linear" in kinds
    if any(s.form == "embedding" for s in adapter.sites):  # rwkv7 pins its embeddings at 8 bits
        assert "outside" in kinds
    if arch in ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v3", "gpt_oss"):
        assert "stack" in kinds
    if arch.startswith(("qwen3_next", "qwen3_5")):
        assert "linear_attn" in kinds


def test_vlm_wrapper_paths_are_real_module_paths():
    model, _ = tiny_models.build("qwen3_5_vlm")
    adapter = ModelAdapter(model)
    paths = {s.path for s in adapter.sites}
    assert "language_model.model.layers.0.linear_attn.in_proj_qkv" in paths
    assert "language_model.lm_head" in paths  # untied head measured as itself
    modules = dict(model.named_modules())
    assert paths <= set(modules)


def test_model_quant_predicate_is_honoured():
    model, _ = tiny_models.build("qwen3_next")
    adapter = ModelAdapter(model)
    paths = {s.path for s in adapter.sites}
    gates = [p for p in dict(model.named_modules()) if p.endswith(("mlp.gate", "shared_expert_gate"))]
    assert gates and not (set(gates) & paths)
    assert all(adapter.fixed[g] == {"bits": 8, "group_size": 64} for g in gates)
    stacks = [s for s in adapter.sites if s.form == "stack"]
    assert stacks and all(s.nparams == 4 * s.shape[1] * s.shape[2] for s in stacks)


class _TwiceModel:
    """A wrapper whose forward calls every block twice: not replayable."""


def test_unreplayable_model_falls_back_with_warning():
    model, _ = tiny_models.build("llama")
    inner = model.model
    cls = type(inner)

    class Twice(cls):
        def __call__(self, inputs, cache=None, input_embeddings=None):
            h = self.embed_tokens(inputs)
            for layer in self.layers:
                h = layer(h, "causal")
            for layer in self.layers:
                h = layer(h, "causal")
            return self.norm(h)

    inner.__class__ = Twice
    toks = _tokens()
    with pytest.warns(RuntimeWarning, match="full forward"):
        rp = Replayer(model, [mx.array(toks)])
    assert not rp.replayable
    adapter = rp.adapter
    ref = model(mx.array(toks))
    site = next(s for s in adapter.sites if s.block == 1)
    c = parse_candidate("2b_g32")
    res = measure_site(rp, site, [c], SweepConfig([c.name]))
    assert res.kl[c.name] == pytest.approx(direct_kl(model, adapter, site, c, toks, ref), rel=1e-6)


PIPELINE_CANDS = ["2b_g32", "3b_g64", "4b_g64", "8b_g128", "ternary_g64", "4b25_2b_g32"]


@pytest.mark.parametrize("arch", ["llama_tied", "qwen3_moe", "qwen3_5_vlm", "gemma3", "deepseek_v2", "mamba",
                                  "rwkv7", "recurrent_gemma", "gemma3n"])
def test_measure_allocate_quantize_load(arch, tmp_path):
    pipeline(*tiny_models.build(arch), tmp_path)


def pipeline(model, cfg, tmp_path):
    """measure -> allocate -> quantize -> save -> load on ``model`` (also
    tests/test_architectures.py's, on every architecture)."""
    import mixbits
    from mixbits.commands.quantize import allocation_candidates, quantize_candidates
    from mixbits.formats.allocation import Allocation
    from mixbits.measure.refine import allocate_table

    toks = _tokens(n=2, seq=16)
    table = sweep(model, toks, tmp_path / "t.json", PIPELINE_CANDS, progress=False)
    # every tensor measured, or left float because no candidate fits it
    left = {e["path"] for e in table.get("float", [])}
    assert {e["path"] for e in table["entries"]} | left == {s.path for s in ModelAdapter(model).sites}
    cands = [parse_candidate(c) for c in PIPELINE_CANDS]
    assert not any(supports(c, ModelAdapter(model).site(p)) for p in left for c in cands)
    alloc, _, _ = allocate_table(table, 4.0)
    Allocation.from_dict(alloc).save(tmp_path / "alloc.json")
    chosen = allocation_candidates(tmp_path / "alloc.json", model)
    assert len({c.name for c in chosen.values()}) > 1  # really mixed
    quantize_candidates(model, chosen)
    want = np.array(model(mx.array(toks)))
    mixbits.save(model, tmp_path / "out", cfg)
    loaded, _, _ = mixbits.load(tmp_path / "out")
    np.testing.assert_array_equal(np.array(loaded(mx.array(toks))), want)
    # (a mixed kind keeps its column permutation even as one segment, K = group size)
    single = all(c.kind != "mixed" and len(c.segments(ModelAdapter(model).site(p).k)) == 1
                 for p, c in chosen.items())
    if single:
        from mlx_lm.utils import load_model  # mlx_lm.load without a tokenizer

        m2, _ = load_model(tmp_path / "out")
        # MLX's own kernels, not ours: equal to the tolerance of the dtype
        # the model runs in (a quantized embedding returns its float16
        # scales' dtype, as MLX defines, so the stream may be half precision).
        got = np.array(m2(mx.array(toks)))
        half = any(s.form == "embedding" for s in ModelAdapter(model).sites
                   if chosen.get(s.path) is not None)
        tol = (4e-3 if half else 1e-5) * float(np.abs(want).max())
        assert np.abs(got - want).max() <= tol


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_5_vlm"])
def test_routing_reaches_wrapped_models(arch, monkeypatch):
    """patch() routes attention/SwiGLU of a VLM wrapper whose blocks live in
    another module (gemma3 -> gemma3_text) and under language_model.*."""
    from mixbits import _ext
    from mixbits.routing import patch_functions, unpatch_functions

    calls = {"attn": 0}
    real = _ext.causal_attention

    def attn(*a):
        calls["attn"] += 1
        return real(*a)

    monkeypatch.setattr(_ext, "causal_attention", attn)
    model, _ = tiny_models.build(arch)
    toks = mx.array(_tokens(seq=6))  # shorter than the sliding window (8): plain causal masks
    want = model(toks)
    assert "scaled_dot_product_attention" in patch_functions(model)
    try:
        got = model(toks)
        mx.eval(got)
        full_attention = sum(1 for b in ModelAdapter(model).blocks if "self_attn" in b)
        assert calls["attn"] == full_attention > 0
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    finally:
        unpatch_functions(model)
