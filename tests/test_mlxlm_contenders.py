"""bench/quality_protocol.py's mlx-lm quantizer contenders (GPTQ, AWQ,
DWQ), on a tiny random llama written as an F32 GGUF and loaded as the
protocol loads its model:

- the storage bpw of a quantized model, from its arrays, against the count
  by hand (codes + an fp16 scale and bias per group);
- scoring a model as a quantizer leaves it: an RTN model that mlx's
  nn.quantize made scores the KL the evaluator gives the equivalent plan,
  and a float64 KL of mlx-lm's float model holding the same dequantized
  weights; the evaluator's own layers come back after;
- parameters outside the sites that a quantizer changed (AWQ's norms) are
  scored with the model: a scale folded exactly into a norm and the
  linears after it leaves the KL at float rounding;
- mlx-lm's GPTQ through the protocol's wrapper quantizes every site.
"""
import sys
from pathlib import Path

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn
from protocol_models import float_llama_evaluator, kl64

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import quality_protocol as qp  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return float_llama_evaluator(tmp_path_factory.mktemp("mlxlm") / "f32.gguf", (4, 32))


def _sites(evs):
    return list(next(iter(evs.values())).sites)


@pytest.mark.parametrize("bits,group,want", [(4, 64, 4 + 32 / 64), (3, 32, 3 + 32 / 32), (2, 64, 2 + 32 / 64)])
def test_quantized_bpw_is_codes_plus_fp16_scale_and_bias(tiny, bits, group, want):
    model, _, evs, _ = tiny
    q = qp.float_twin(model)
    nn.quantize(q, group_size=group, bits=bits)
    qp._fp16_storage(q)
    assert qp.quantized_bpw(q, _sites(evs)) == pytest.approx(want, abs=1e-12)
    # a site left in float is refused, not counted as something else
    f = qp.float_twin(model)
    with pytest.raises(ValueError, match="not an affine quantized layer"):
        qp.quantized_bpw(f, _sites(evs))


def test_score_model_of_rtn_is_the_plans_kl_and_a_float64_kl(tiny):
    from mixbits.nn import patch

    model, ref, evs, tokens = tiny
    sites = _sites(evs)
    q = qp.float_twin(model)
    nn.quantize(q, group_size=64, bits=4)
    qp._fp16_storage(q)
    mods = dict(q.named_modules())
    # independent: mlx-lm's float model holding q's dequantized weights, KL in float64
    deq = {f"{p}.weight": mx.dequantize(mods[p].weight, mods[p].scales, mods[p].biases, 64, 4).astype(mx.float32)
           for p in sites}
    ref.load_weights(list(deq.items()), strict=False)
    ref_logits = np.concatenate([np.array(lg) for lg in evs["a"].ref_logits])
    want = kl64(ref_logits, np.array(ref(mx.array(tokens))))
    assert want.min() > 1e-4  # quantizing changed the model
    patch(q)
    got = np.array(qp.score_model(evs, q)["a"])
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-7)
    # the evaluator's plan of the same kind (its own RTN layers) scores the same
    plan = np.array(evs["a"].sequence_kls({p: "4b_g64" for p in sites}))
    np.testing.assert_allclose(got, plan, rtol=2e-3, atol=1e-7)
    # the evaluator's own layers are back: the reference scores zero
    assert np.abs(evs["a"].sequence_kls({})).max() < 1e-6


def test_score_model_loads_the_norms_a_quantizer_changed(tiny):
    from mlx.utils import tree_flatten

    model, _, evs, _ = tiny
    before = {k: np.array(v) for k, v in tree_flatten(model.parameters()) if "norm" in k}
    q = qp.float_twin(model)
    blk = q.model.layers[0]
    s = mx.array(np.random.default_rng(1).uniform(0.25, 4.0, blk.input_layernorm.weight.shape).astype(np.float32))
    # AWQ's fold: the norm's weight over s, the columns of the linears it feeds times s
    blk.input_layernorm.weight = blk.input_layernorm.weight / s
    for name in ("q_proj", "k_proj", "v_proj"):
        lin = blk.self_attn[name]
        lin.weight = lin.weight * s
    folded = np.array(qp.score_model(evs, q)["a"])
    assert folded.max() < 1e-5  # the same function: KL at float rounding
    # the norm alone (the linears as loaded) is a different model: the swap is what made it equal
    q2 = qp.float_twin(model)
    q2.model.layers[0].input_layernorm.weight = q2.model.layers[0].input_layernorm.weight / s
    assert np.array(qp.score_model(evs, q2)["a"]).min() > 1e-3
    after = {k: np.array(v) for k, v in tree_flatten(model.parameters()) if "norm" in k}
    assert all(np.array_equal(before[k], after[k]) for k in before)  # put back
    assert np.abs(evs["a"].sequence_kls({})).max() < 1e-6


def test_gptq_wrapper_quantizes_every_site_and_restores_mlx(tiny):
    from mlx_lm.quant import gptq

    model, _, evs, tokens = tiny
    matmul, switch = mx.array.__matmul__, gptq.SwitchLinear
    q = qp.gptq_model(model, tokens, 4, 64)
    assert mx.array.__matmul__ is matmul and gptq.SwitchLinear is switch
    mods = dict(q.named_modules())
    assert all(isinstance(mods[p], (nn.QuantizedLinear, nn.QuantizedEmbedding)) and mods[p].bits == 4
               for p in _sites(evs))
    # GPTQ moved codes away from round-to-nearest in the block linears (error feedback)
    r = qp.float_twin(model)
    nn.quantize(r, group_size=64, bits=4)
    rm = dict(r.named_modules())
    lin = [p for p in _sites(evs) if "layers" in p]
    assert any(not mx.array_equal(mods[p].weight, rm[p].weight).item() for p in lin)
    # and what it minimizes is lower: block 0's q/k/v output error on the calibration inputs
    f = qp.float_twin(model)
    x = np.array(f.model.layers[0].input_layernorm(f.model.embed_tokens(mx.array(tokens)))).reshape(-1, 256)
    for name in ("q_proj", "k_proj", "v_proj"):
        w = np.array(f.model.layers[0].self_attn[name].weight, dtype=np.float64)
        err = {}
        for tag, m in (("gptq", mods), ("rtn", rm)):
            ql = m[f"model.layers.0.self_attn.{name}"]
            dq = np.array(mx.dequantize(ql.weight, ql.scales, ql.biases, 64, 4), dtype=np.float64)
            err[tag] = np.linalg.norm(x @ (w - dq).T)
        assert err["gptq"] < err["rtn"], (name, err)
    with pytest.raises(ValueError, match="packs"):
        qp.gptq_model(model, tokens, 3, 64)


def test_widths_take_the_finest_group_within_each_budget(tiny):
    from mixbits.measure.candidates import parse_candidate

    _, _, evs, _ = tiny
    sites = list(next(iter(evs.values())).adapter.sites)

    def bpw(plan):
        return parse_candidate(next(iter(plan.values()))).storage_bpw

    budgets = [3.0, 3.5, 4.0, 4.5, 5.0]
    assert qp.mlxlm_widths("gptq", sites, bpw, budgets) == [(2, 32), (4, 32), (4, 64)]
    assert qp.mlxlm_widths("awq", sites, bpw, budgets) == [(2, 32), (3, 32), (3, 64), (4, 32), (4, 64)]


def test_awq_routes_compute_mlx_products_and_leave_mlx_as_it_was():
    rng = np.random.default_rng(2)
    x = mx.array(rng.normal(size=(40, 3, 64)).astype(np.float32))
    w = mx.array(rng.normal(size=(24, 3, 64)).astype(np.float32))
    want = np.einsum("bdg,odg->bod", np.array(x, dtype=np.float64), np.array(w, dtype=np.float64))
    lin = nn.Linear(192, 24)
    q = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=3)
    ref = np.array(q(x.reshape(40, 192)))
    quantize, einsum = nn.quantize, mx.einsum
    outer = nn.Sequential(nn.Linear(192, 24))
    with qp.awq_routes(outer):
        got = np.array(mx.einsum("bdg,odg->bod", x, w))
        nn.quantize(outer, group_size=64, bits=3)
        assert type(outer.layers[0]) is qp._KernelQuantizedLinear
        outer.layers[0].update(q.parameters())
        routed = np.array(outer.layers[0](x.reshape(40, 192)))
    assert nn.quantize is quantize and mx.einsum is einsum
    assert type(outer.layers[0]) is nn.QuantizedLinear
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(routed, ref, rtol=1e-4, atol=1e-4)


def test_awq_wrapper_quantizes_every_site_and_scores(tiny):
    model, _, evs, tokens = tiny
    q = qp.awq_model(model, tokens, 4, 64, "llama")
    mods = dict(q.named_modules())
    sites = _sites(evs)
    assert all(type(mods[p]) in (nn.QuantizedLinear, nn.QuantizedEmbedding) and mods[p].bits == 4 for p in sites)
    qp._fp16_storage(q)
    assert qp.quantized_bpw(q, sites) == pytest.approx(4.5, abs=1e-12)
    from mixbits.nn import patch

    patch(q)
    kl = np.array(qp.score_model(evs, q)["a"])
    assert np.isfinite(kl).all() and kl.min() > 0


def test_dwq_wrapper_trains_scales_from_rtn(tiny):
    model, _, evs, tokens = tiny
    q, info = qp.dwq_model(model, tokens, 4, 64, epochs=3)
    assert info["steps"] == 3 and info["valid_loss_before"] is not None and info["valid_loss_after"] is not None
    r = qp.float_twin(model)
    nn.quantize(r, group_size=64, bits=4)
    mods, rm = dict(q.named_modules()), dict(r.named_modules())
    sites = _sites(evs)
    assert all(type(mods[p]) in (nn.QuantizedLinear, nn.QuantizedEmbedding) for p in sites)
    # the codes are RTN's; the scales moved (trained), the sizes did not
    assert all(mx.array_equal(mods[p].weight, rm[p].weight).item() for p in sites)
    assert any(not mx.array_equal(mods[p].scales, rm[p].scales).item() for p in sites)
    qp._fp16_storage(q)
    assert qp.quantized_bpw(q, sites) == pytest.approx(4.5, abs=1e-12)
