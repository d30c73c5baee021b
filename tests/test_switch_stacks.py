"""Expert stacks (mlx-lm's SwitchLinear / QuantizedSwitchLinear) through
every model-level path, on tiny random MoE models (tests/tiny_models.py):

- ``mixbits.patch`` swaps QuantizedSwitchLinear for
  MixedQuantizedSwitchLinear sharing the arrays: logits equal mlx-lm's;
  non-affine stacks refused (strict) or left alone;
- ``quantize_model`` with mixed segments and a permutation on experts
  equals a reference built by hand (each expert quantized with
  mx.quantize, dequantized with mx.dequantize, put back into float
  SwitchLinear weights and run through mlx-lm's own gather_mm);
- save -> mixbits.load gives identical logits;
- sweep (mixed candidate) -> allocate -> ``mixbits quantize``: the saved
  expert stacks are exactly the allocation's candidates;
- bad input is refused before any module changes.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

import mixbits
import tiny_models
from mixbits.adapter import ModelAdapter, get_module
from mixbits.nn import MixedQuantizedLinear, MixedQuantizedSwitchLinear

# qwen3_moe: K=64 everywhere, no expert bias; gpt_oss: expert biases and a
# K=128 down projection; qwen3_5_moe: a VLM wrapper with shared experts;
# deepseek_v3: a dense first layer and MultiLinear heads beside the experts.
MOE = ["qwen3_moe", "gpt_oss", "qwen3_5_moe", "deepseek_v3"]
SEQ = 12


def _tokens(seed=0, n=2):
    return mx.array(np.random.default_rng(seed).integers(0, 160, (n, SEQ)))


def _stacks(model, cls=(SwitchLinear, QuantizedSwitchLinear, MixedQuantizedSwitchLinear)):
    return {p: m for p, m in model.named_modules() if isinstance(m, cls)}


def _stock(arch, expert_mode=None):
    """mlx-lm's own 4-bit g64 quantization of the tiny model (router gates
    at 8 bits by the model's quant_predicate); ``expert_mode`` quantizes
    the expert stacks in another MLX mode instead."""
    from mlx_lm.utils import quantize_model

    model, cfg = tiny_models.build(arch)
    pred = getattr(model, "quant_predicate", None)

    def predicate(path, m):
        if expert_mode and isinstance(m, SwitchLinear):
            return {"group_size": 32, "bits": 4, "mode": expert_mode}
        return pred(path, m) if pred else True

    quantize_model(model, cfg, 64, 4, quant_predicate=predicate)
    mx.eval(model.parameters())
    return model, cfg


def _close(got, want, rtol=1e-5):
    got, want = np.array(got, dtype=np.float64), np.array(want, dtype=np.float64)
    assert got.shape == want.shape
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= rtol, f"relative max error {err:.3g} > {rtol}"


# ------------------------------------------------------------------ patch


@pytest.mark.parametrize("arch", MOE)
def test_patch_replaces_expert_stacks_with_equal_logits(arch):
    model, _ = _stock(arch)
    toks = _tokens()
    want = model(toks)
    stock = _stacks(model, QuantizedSwitchLinear)
    assert len(stock) >= 9 and len(stock) % 3 == 0  # gate/up/down of 3-4 MoE layers
    arrays = {p: m["weight"] for p, m in stock.items()}
    # functions=False: the layers alone (the routed norm/rope/attention
    # kernels round differently from MLX's ops, by ~1e-5 of the logits here)
    paths = mixbits.patch(model, functions=False)
    assert set(stock) <= set(paths)
    after = _stacks(model)
    assert set(after) == set(stock)
    for p, m in after.items():
        assert isinstance(m, MixedQuantizedSwitchLinear)
        assert m["weight"] is arrays[p]  # shared, not re-quantized
        assert ("bias" in m) == ("bias" in stock[p])
    # Same arrays, different kernels: float tolerance.
    _close(model(toks), want)


def test_patch_leaves_non_affine_stacks_to_mlx():
    """mxfp4 expert stacks stay mlx-lm's (MLX runs them), strict or not;
    the affine layers around them are patched."""
    model, _ = _stock("qwen3_moe", expert_mode="mxfp4")
    stock = _stacks(model, QuantizedSwitchLinear)
    paths = mixbits.patch(model)
    assert not set(paths) & set(stock)
    assert all(isinstance(get_module(model, p), QuantizedSwitchLinear) for p in stock)
    assert any(isinstance(get_module(model, p), MixedQuantizedLinear) for p in paths)


def test_patch_activations_reach_expert_stacks():
    model, _ = _stock("qwen3_moe")
    toks = _tokens()  # 24 rows: the linears' calls take the float path, the experts' (top-2 of 4) may not
    want = model(toks)
    mixbits.patch(model, activations="int16")
    stacks = _stacks(model, MixedQuantizedSwitchLinear)
    linears = [m for _, m in model.named_modules() if isinstance(m, MixedQuantizedLinear)]
    assert stacks and all(m.activations == "int16" for m in stacks.values())
    assert linears and all(m.activations == "int16" for m in linears)
    got = model(toks)
    _close(got, want, rtol=1e-3)  # int16: the float model's answer (measured 1.9e-5)
    for m in stacks.values():  # ...through the experts' integer contract
        m.activations = "float"
    assert not np.array_equal(np.array(got), np.array(model(toks)))
    # int8 too; its coarser steps move this tiny random model's logits by
    # up to 15% of the largest (the contract's own bound is tested in
    # tests/test_gather_int8.py)
    mixbits.patch(model, activations="int8")
    assert all(m.activations == "int8" for m in stacks.values())
    _close(model(toks), want, rtol=0.3)


# ------------------------------------------------------------ quantize_model


def _mixed_spec(k, rng):
    """Two segments (wide first) and a random permutation for K=k."""
    return {"segments": [(8, 32, k // 2), (3, 32, k // 2)], "perm": rng.permutation(k)}


def _reference_stack(w, spec):
    """Dequantized (E, N, K) weight, expert by expert, with MLX's own
    quantize/dequantize and numpy for the permutation."""
    w = np.array(w, dtype=np.float32)
    perm = np.asarray(spec["perm"])
    out = np.empty_like(w)
    for e in range(w.shape[0]):
        wp = w[e][:, perm]
        parts, k0 = [], 0
        for bits, gs, k in spec["segments"]:
            q, s, b = mx.quantize(mx.array(wp[:, k0:k0 + k]), group_size=gs, bits=bits)
            parts.append(np.array(mx.dequantize(q, s, b, group_size=gs, bits=bits)))
            k0 += k
        deq = np.concatenate(parts, axis=1)
        out[e][:, perm] = deq  # stored column j is original column perm[j]
    return out


@pytest.mark.parametrize("source", ["float", "stock", "mixbits"])
@pytest.mark.parametrize("arch", MOE)
def test_quantize_model_mixed_experts_match_reference(arch, source):
    """Experts from float SwitchLinear, stock QuantizedSwitchLinear or
    MixedQuantizedSwitchLinear, quantized with two segments and a
    permutation: logits equal the same model with float SwitchLinear
    experts holding the reference's dequantized weights."""
    if source == "float":
        model, _ = tiny_models.build(arch)
    else:
        model, _ = _stock(arch)
        if source == "mixbits":
            mixbits.patch(model, functions=False)
    rng = np.random.default_rng(1)
    assignment, dense, bias = {}, {}, {}
    for p, m in _stacks(model).items():
        if source == "float":
            w = m.weight
        else:  # one segment, no perm: MLX's layout in both classes
            bits, gs = (m.bits, m.group_size) if source == "stock" else m.layout.specs[0][:2]
            w = mx.dequantize(m["weight"], m["scales"], m["biases"], group_size=gs, bits=bits)
        dense[p], bias[p] = np.array(w), m.get("bias")
        assignment[p] = _mixed_spec(w.shape[-1], rng)
    replaced = mixbits.quantize_model(model, assignment)
    assert sorted(replaced) == sorted(assignment)
    for p, spec in assignment.items():
        m = get_module(model, p)
        assert isinstance(m, MixedQuantizedSwitchLinear)
        assert m.layout.specs == tuple(tuple(s) for s in spec["segments"])
        np.testing.assert_array_equal(np.array(m["perm"]), spec["perm"])
    toks = _tokens(2)
    got = model(toks)
    # The reference: the same model, experts as float SwitchLinear holding
    # each expert's weight quantized and dequantized by hand.
    adapter = ModelAdapter(model)
    for p, spec in assignment.items():
        e, n, k = dense[p].shape
        ref = SwitchLinear(k, n, e, bias=bias[p] is not None)
        ref.weight = mx.array(_reference_stack(dense[p], spec))
        if bias[p] is not None:
            ref.bias = bias[p]
        adapter.set(p, ref)
    _close(got, model(toks))


# ------------------------------------------------------------ save / load


@pytest.mark.parametrize("arch", MOE)
def test_save_load_round_trip(arch, tmp_path):
    model, cfg = _stock(arch)
    mixbits.patch(model, functions=False)
    stacks = sorted(_stacks(model))
    block = {p: ModelAdapter(model).block_of(p) for p in stacks}
    first, second, third = sorted(set(block.values()))[:3]
    rng = np.random.default_rng(3)
    # Mixed + permuted experts in the first MoE layer, one-segment mixbits
    # stacks in the second (written as MLX entries too), mlx-lm's class in
    # the third, and patched (shared-array) ones after.
    mixed = [p for p in stacks if block[p] == first]
    assignment = {p: _mixed_spec(get_module(model, p).input_dims, rng) for p in mixed}
    assignment.update({p: [(3, 32, get_module(model, p).input_dims)] for p in stacks if block[p] == second})
    mixbits.quantize_model(model, assignment)
    stock_paths = [p for p in stacks if block[p] == third]
    for p in stock_paths:  # back to mlx-lm's class for these
        m = get_module(model, p)
        q = QuantizedSwitchLinear(m.input_dims, m.output_dims, m.num_experts, bias=False)
        q.weight, q.scales, q.biases = m["weight"], m["scales"], m["biases"]
        if "bias" in m:
            q.bias = m["bias"]
        ModelAdapter(model).set(p, q)
    toks = _tokens(4)
    want = np.array(model(toks))
    mixbits.save(model, tmp_path / "out", cfg)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    layers, quant = saved["mixbits"]["layers"], saved["quantization"]
    for p in stacks:
        if p in mixed:
            assert p in layers and p not in quant and layers[p]["perm"] is True
        elif p in assignment:
            assert p in layers and quant[p] == {"group_size": 32, "bits": 3}
    assert all(p not in layers and p in quant for p in stock_paths)
    loaded, _, _ = mixbits.load(tmp_path / "out")
    for p in stacks:
        got = get_module(loaded, p)
        assert type(got) is type(get_module(model, p)), p
    np.testing.assert_array_equal(np.array(loaded(toks)), want)


def test_single_segment_stacks_load_with_mlx_lm(tmp_path):
    from mlx_lm.utils import load_model

    model, cfg = tiny_models.build("gpt_oss")
    mixbits.quantize_model(model, {p: [(4, 32, m.weight.shape[-1])] for p, m in _stacks(model).items()})
    toks = _tokens(5)
    want = np.array(model(toks))
    mixbits.save(model, tmp_path / "out", cfg)
    m2, _ = load_model(tmp_path / "out")
    assert all(isinstance(m, QuantizedSwitchLinear) for m in _stacks(m2).values())
    _close(m2(toks), want)  # MLX's kernels, the same arrays


# ------------------------------------------------------- measure -> quantize


def test_measure_allocate_quantize_saves_the_measured_experts(tmp_path):
    from mixbits.cli import main
    from mixbits.formats.allocation import Allocation
    from mixbits.measure.candidates import build_layer, parse_candidate
    from mixbits.measure.refine import allocate_table
    from mixbits.measure.sweep import sweep

    model, cfg = tiny_models.build("qwen3_moe")
    mixbits.save(model, tmp_path / "src", cfg)
    adapter = ModelAdapter(model)
    experts = [s.path for s in adapter.sites if s.experts]
    toks = np.random.default_rng(6).integers(0, 160, (2, 16))
    cands = ["2b_g32", "4b25_2b_g32"]  # mixed: half the columns at 4 bits (K=64)
    table = sweep(model, toks, tmp_path / "t.json", cands, sites=experts, progress=False)
    assert {c["kind"] for e in table["entries"] for c in e["candidates"]} == set(cands)
    bpw = np.mean([c["bpw"] for e in table["entries"] for c in e["candidates"]])
    alloc, _, _ = allocate_table(table, float(bpw))
    Allocation.from_dict(alloc).save(tmp_path / "alloc.json")
    chosen = {e["path"]: parse_candidate(e["kind"]) for e in alloc["assignment"]}
    assert {c.kind for c in chosen.values()} == {"uniform", "mixed"}, "the budget should force both kinds"
    assert main(["quantize", "--model", str(tmp_path / "src"), "--allocation",
                 str(tmp_path / "alloc.json"), "--out", str(tmp_path / "q")]) == 0
    loaded, _, _ = mixbits.load(tmp_path / "q")
    for path, cand in chosen.items():
        got = get_module(loaded, path)
        want = build_layer(adapter.get(path), cand)  # what the sweep measured
        k = adapter.site(path).k
        if cand.kind == "mixed":
            assert isinstance(got, MixedQuantizedSwitchLinear)
            assert list(got.layout.specs) == [tuple(s) for s in cand.segments(k)]
            np.testing.assert_array_equal(np.array(got["perm"]),
                                          cand.perm(np.array(adapter.get(path).weight)))
        else:
            assert isinstance(got, QuantizedSwitchLinear) and (got.bits, got.group_size) == (2, 32)
        have = dict(tree_flatten(got.parameters()))
        ref = dict(tree_flatten(want.parameters()))
        assert have.keys() == ref.keys()
        for name in have:
            np.testing.assert_array_equal(np.array(have[name]), np.array(ref[name]), err_msg=f"{path}.{name}")


def test_uniform_candidate_on_a_mixbits_stack_is_mlx_lms_class():
    """Re-measuring a loaded mixbits model: a single-segment candidate on a
    MixedQuantizedSwitchLinear gives mlx-lm's QuantizedSwitchLinear (bias
    kept), the same arrays as from a float stack of the same weights."""
    from mixbits.measure.candidates import build_layer, parse_candidate

    rng = np.random.default_rng(8)
    sl = SwitchLinear(128, 16, 3, bias=True)
    sl.bias = mx.array(rng.standard_normal((3, 16)).astype(np.float32))
    mixed = MixedQuantizedSwitchLinear.from_switch_linear(sl, [(8, 64, 64), (3, 32, 64)],
                                                          perm=rng.permutation(128))
    twin = SwitchLinear(128, 16, 3, bias=True)
    twin.weight, twin.bias = mixed.quantized_tensor().dequantize(unpermute=True), sl.bias
    for name in ("3b_g32", "4b25_2b_g32"):
        got, want = (build_layer(m, parse_candidate(name)) for m in (mixed, twin))
        assert type(got) is type(want)
        assert isinstance(got, QuantizedSwitchLinear if name == "3b_g32" else MixedQuantizedSwitchLinear)
        have, ref = dict(tree_flatten(got.parameters())), dict(tree_flatten(want.parameters()))
        assert have.keys() == ref.keys() and "bias" in have
        for k in have:
            np.testing.assert_array_equal(np.array(have[k]), np.array(ref[k]), err_msg=f"{name} {k}")


def test_expert_perm_ranks_column_norms_summed_over_experts():
    from mixbits.measure.candidates import parse_candidate

    rng = np.random.default_rng(7)
    w = rng.standard_normal((3, 8, 64)).astype(np.float32)
    w[1, :, 5] *= 50  # salient in one expert only: still first for the stack
    w[:, :, 9] *= 3   # moderately salient in every expert
    perm = parse_candidate("4b25_2b_g32").perm(w)
    want = np.argsort(-sum(np.linalg.norm(w[e], axis=0) for e in range(3)), kind="stable")
    np.testing.assert_array_equal(perm, want)
    assert list(perm[:2]) == [5, 9]
    # A 2-D weight is ranked as before: the column norms.
    np.testing.assert_array_equal(parse_candidate("4b25_2b_g32").perm(w[0]),
                                  np.argsort(-np.linalg.norm(w[0], axis=0), kind="stable"))


# ------------------------------------------------------------ bad input


def _snapshot(model):
    return {p: (type(m), [id(v) for _, v in tree_flatten(m.parameters())]) for p, m in model.named_modules()}


def test_quantize_model_bad_expert_input_changes_nothing():
    model, _ = tiny_models.build("gpt_oss")
    stacks = sorted(_stacks(model))
    lin = next(p for p, m in model.named_modules() if isinstance(m, nn.Linear))
    down = next(p for p in stacks if p.endswith("down_proj"))  # K = 128
    before = _snapshot(model)
    with pytest.raises(ValueError, match=rf"assignment\['{down}'\].*sum to 96 .*K=128.*\(4, 64, 128\)"):
        mixbits.quantize_model(model, {lin: 4, down: [(4, 32, 64), (3, 32, 32)]})
    with pytest.raises(ValueError, match=rf"assignment\['{down}'\].*bits must be one of"):
        mixbits.quantize_model(model, {lin: 4, down: [(7, 32, 128)]})
    with pytest.raises(ValueError, match=rf"assignment\['{down}'\].*perm"):
        mixbits.quantize_model(model, {lin: 4, down: {"segments": [(4, 32, 128)], "perm": np.arange(64)}})
    assert _snapshot(model) == before


def test_multi_head_stacks_take_no_mixed_segments():
    from mixbits.measure.candidates import build_layer, parse_candidate, supports

    model, _ = tiny_models.build("deepseek_v3")
    adapter = ModelAdapter(model)
    mixed = parse_candidate("4b25_2b_g32")
    heads = [s for s in adapter.sites if s.form == "stack" and not s.experts]
    experts = [s for s in adapter.sites if s.experts]
    assert heads and experts
    # The tiny heads have K=16 (no group size fits): the same head at K=64,
    # where a uniform kind fits and the mixed one must still not.
    import dataclasses

    from mlx_lm.models.mla import MultiLinear

    wide = dataclasses.replace(heads[0], shape=(4, 16, 64))
    assert supports(parse_candidate("4b_g32"), wide) and not supports(mixed, wide)
    assert all(supports(mixed, s) for s in experts)
    with pytest.raises(ValueError, match="MultiLinear stacks"):
        build_layer(MultiLinear(64, 16, 4), mixed)
    before = _snapshot(model)
    with pytest.raises(TypeError, match="MultiLinear, not a linear, embedding or expert-stack"):
        mixbits.quantize_model(model, {experts[0].path: 4, heads[0].path: 4})
    assert _snapshot(model) == before
