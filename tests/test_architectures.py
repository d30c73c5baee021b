"""Every architecture in the installed mlx-lm's models/ folder, from
tests/data/architectures (written by tests/arch_configs.py --write):

- the data covers exactly the folder's architectures, each a tiny config
  or a one-line reason it is refused (an mlx-lm bump that adds one fails
  here until the data is regenerated);
- on every covered one: the sweep's reference is model(tokens) and one
  tensor's table KL equals the KL of that candidate in the real model;
  mixbits.patch leaves prompt and decode logits unchanged;
- on a fixed subset (not already in test_any_model): measure -> allocate
  -> quantize -> save -> mixbits.load gives identical logits.

The whole list with every check, timed: bench/all_architectures.py."""

from __future__ import annotations

import numpy as np
import pytest

import arch_checks
import arch_configs

NAMES = sorted(p.stem for p in arch_configs.DATA.glob("*.json"))
COVERED = [n for n in NAMES if "refused" not in arch_configs.load(n)]
# Pipeline subset: one of each family test_any_model does not run it on.
# afm7: its fused qkv_proj (a Linear subclass splitting its product) stays float.
PIPELINE = ["afm7", "bailing_hybrid", "cohere2", "falcon_h1", "gemma4", "granitemoehybrid", "jamba",
            "kimi_linear", "lfm2", "llama4", "nemotron_h", "olmoe", "starcoder2"]


def _rotating(k: int = 8) -> list[str]:
    """k more, a different slice each UTC day (every architecture within
    a few weeks); MIXBITS_ALL_ARCHITECTURES=1: all of them."""
    import datetime
    import os

    rest = [n for n in COVERED if n not in PIPELINE]
    if os.environ.get("MIXBITS_ALL_ARCHITECTURES") == "1":
        return rest
    day = datetime.datetime.now(datetime.timezone.utc).toordinal()
    start = (day * k) % len(rest)
    return (rest + rest)[start:start + k]


PIPELINE = PIPELINE + _rotating()


def test_data_covers_the_installed_models_folder():
    assert NAMES == arch_configs.architectures()
    for n in NAMES:
        cfg = arch_configs.load(n)
        if "refused" in cfg:
            reason = cfg["refused"]
            assert isinstance(reason, str) and reason.strip() and "\n" not in reason, n
            assert set(cfg) == {"refused"}, n
        else:
            assert cfg["model_type"], n
    assert len(COVERED) >= 100


@pytest.mark.parametrize("arch", COVERED)
def test_reference_kl_and_patch(arch):
    model, _ = arch_configs.build(arch)
    rp, _ = arch_checks.reference(model)
    [(path, cand, kl, direct)] = arch_checks.kl_roles(model, rp, roles=1)
    assert direct > 0, (path, cand)
    assert kl == pytest.approx(direct, rel=1e-4), (path, cand)
    (want_prompt, want_step), (got_prompt, got_step) = arch_checks.patched_logits(model)
    # RMSNorm / RoPE / attention on mixbits' kernels: float32 rounding apart.
    np.testing.assert_allclose(got_prompt, want_prompt, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_step, want_step, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", PIPELINE)
def test_pipeline(arch, tmp_path):
    assert arch in COVERED
    arch_checks.pipeline(*arch_configs.build(arch), tmp_path)


def test_configs_are_small():
    """CI-sized: widths <= 64 (afm7's hidden_dim 128 is its MLP), vocabulary
    <= 256, at most 4 layers, in the config and in a wrapper's text_config
    (arch_configs.build also refuses more than MAX_PARAMS parameters)."""
    for n in COVERED:
        cfg = arch_configs.load(n)
        for d in (cfg, cfg.get("text_config") or {}):
            for key, most in (("hidden_size", 64), ("d_model", 64), ("n_embd", 64), ("dim", 64),
                              ("vocab_size", 256), ("num_hidden_layers", 4), ("num_layers", 4)):
                assert d.get(key, 0) <= most, (n, key, d[key])


def test_leaf_with_a_batch_shared_input():
    """gpt2's position embedding gets arange(T), no batch axis: each
    candidate is measured on its own forward, not sliced out of a shared
    one (a broadcast error before; with one candidate, positions 0-1 only)."""
    import mlx.core as mx

    from mixbits.measure.candidates import parse_candidate
    from mixbits.measure.sweep import SweepConfig, measure_site
    from test_any_model import direct_kl

    model, _ = arch_configs.build("gpt2")
    rp, _ = arch_checks.reference(model)
    site = rp.adapter.site("model.wpe")
    cands = [parse_candidate(c) for c in ("2b_g32", "4b_g32")]
    res = measure_site(rp, site, cands, SweepConfig([c.name for c in cands], max_batch=8))
    toks = arch_checks.tokens()
    ref = model(mx.array(toks))
    for c in cands:
        direct = direct_kl(model, rp.adapter, site, c, toks, ref)
        assert direct > 0 and res.kl[c.name] == pytest.approx(direct, rel=1e-4), c.name


def test_block_state_arguments_fall_back():
    """deepseek_v41 makes its own per-layer caches when given none and
    passes them to its blocks: a replay read the reference forward's keys
    back (table KL 0 for kv_proj against 0.026 in the real model). Such a
    model is measured with full forwards, with the warning."""
    model, _ = arch_configs.build("deepseek_v41")
    rp, replayable = arch_checks.reference(model)  # (asserts the warning came)
    assert not replayable and "LayerCache" in rp.reason
    roles = arch_checks.kl_roles(model, rp)
    assert any(p.endswith("self_attn.kv_proj") for p, *_ in roles)
    for path, cand, kl, direct in roles:
        assert direct > 0 and kl == pytest.approx(direct, rel=1e-4), (path, cand)


def test_linear_with_its_own_call_stays_float(tmp_path):
    """afm7's qkv_proj is a FusedLinear whose __call__ splits the product
    into q, k, v: a mixbits layer in its place returned one array (the
    model's unpacking failed). No candidate fits it: float, listed."""
    from mixbits.measure.sweep import sweep

    model, _ = arch_configs.build("afm7")
    with pytest.warns(UserWarning, match="FusedLinear"):
        table = sweep(model, arch_checks.tokens(), tmp_path / "t.json", ["4b_g64"], progress=False)
    fused = {p for p, m in model.named_modules() if type(m).__name__ == "FusedLinear"}
    assert fused and fused == {e["path"] for e in table["float"] if "FusedLinear" in e["reason"]}
