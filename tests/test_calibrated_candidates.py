"""Calibrated quantizers as sweep candidates (``+search``, ``+gptq``): the
layer inputs come from the sweep's own replay, the measured candidate is
exactly what ``quantize`` saves, and they beat round-to-nearest."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import tiny_models
from mixbits.adapter import ModelAdapter
from mixbits.measure.candidates import build_layer, parse_candidate, supports
from mixbits.measure.replay import Replayer
from mixbits.measure.sweep import SweepConfig, kl_per_token, measure_site, sweep


def test_codec():
    c = parse_candidate("4b10_3b_g64+gptq")
    assert (c.kind, c.quantizer, c.calibrated, c.hi_bits) == ("mixed", "gptq", True, 4)
    assert parse_candidate("3b_g64").quantizer == "rtn"
    with pytest.raises(ValueError, match="unknown quantizer"):
        parse_candidate("3b_g64+magic")
    model, _ = tiny_models.build("qwen3_moe")
    ad = ModelAdapter(model)
    kinds = {(s.form, s.block is not None): supports(c, s) for s in ad.sites}
    assert kinds == {("embedding", False): False, ("linear", True): True, ("stack", True): False,
                     ("linear", False): False}
    head = next(s for s in ad.sites if s.path == "lm_head")
    assert not supports(c, head)  # its input is not recorded by a block replay
    # +search needs no input: it searches the plain squared error outside the blocks
    srch = parse_candidate("4b10_3b_g64+search")
    kinds = {(s.form, s.block is not None): supports(srch, s) for s in ad.sites}
    assert kinds == {("embedding", False): True, ("linear", True): True, ("stack", True): False,
                     ("linear", False): True}


def _decoded(layer, w):
    """The weight a built embedding or linear computes with, float64."""
    from mixbits.nn import MixedQuantizedEmbedding

    if isinstance(layer, MixedQuantizedEmbedding):
        got = layer(mx.arange(w.shape[0])[None])[0]  # every row looked up
    else:
        got = layer(mx.eye(w.shape[1], dtype=mx.float32)).T  # W = (I W^T)^T
    return np.array(got.astype(mx.float32), dtype=np.float64)


@pytest.mark.parametrize("kind", ["3b_g64+search", "4b10_3b_g64+search"])
def test_search_outside_the_blocks_beats_rtn(kind):
    """An embedding and an untied head at ``+search`` are built without layer
    inputs: each group's squared error is at most what MLX's own
    mx.quantize/mx.dequantize leave (uniform: group by group), the mixed
    kind's total below its round-to-nearest build (same permutation), and
    the embedding stays an embedding."""
    from mixbits.nn import MixedQuantizedEmbedding, MixedQuantizedLinear

    model, _ = tiny_models.build("qwen3_moe")
    ad = ModelAdapter(model)
    cand = parse_candidate(kind)
    for path, cls in (("model.embed_tokens", MixedQuantizedEmbedding), ("lm_head", MixedQuantizedLinear)):
        module = ad.get(path)
        w = module.weight
        layer = build_layer(module, cand, None, None)
        assert isinstance(layer, cls)
        got, wf = _decoded(layer, w), np.array(w.astype(mx.float32), dtype=np.float64)
        if cand.kind == "uniform":
            rtn = np.array(mx.dequantize(*mx.quantize(w, group_size=64, bits=3), group_size=64, bits=3)
                           .astype(mx.float32), dtype=np.float64)
            per_group = lambda a: ((a - wf) ** 2).reshape(wf.shape[0], -1, 64).sum(-1)
            assert (per_group(got) <= per_group(rtn) * (1 + 1e-5) + 1e-12).all()
            assert per_group(got).sum() < 0.95 * per_group(rtn).sum()
        else:
            rtn = _decoded(build_layer(module, parse_candidate(cand.name.split("+")[0]), None), w)
            assert ((got - wf) ** 2).sum() < 0.95 * ((rtn - wf) ** 2).sum()


class _Capture(nn.Module):
    def __init__(self, inner, store):
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "store", store)

    def __call__(self, x):
        self.store.append(np.array(x, dtype=np.float64).reshape(-1, x.shape[-1]))
        return self.inner(x)


def test_layer_inputs_and_kl_from_the_models_own_forward():
    model, _ = tiny_models.build("gemma3")
    toks = np.random.default_rng(0).integers(0, 160, (2, 16))
    ad = ModelAdapter(model)
    rp = Replayer(model, [mx.array(toks[:1]), mx.array(toks[1:])], ad)
    site = ad.site("language_model.model.layers.2.mlp.down_proj")
    H, n = rp.input_hessian(site)
    # independent: capture the layer's inputs during plain model(tokens)
    store = []
    orig = ad.get(site.path)
    ad.set(site.path, _Capture(orig, store))
    ref = model(mx.array(toks))
    ad.set(site.path, orig)
    X = np.concatenate(store)
    assert n == X.shape[0] == toks.size
    np.testing.assert_allclose(np.array(H), X.T @ X, rtol=2e-4, atol=1e-3)
    cands = [parse_candidate(c) for c in ("2b_g64", "2b_g64+search", "2b_g64+gptq")]
    res = measure_site(rp, site, cands, SweepConfig([c.name for c in cands]))
    # the candidate built from those inputs, placed in the real model (the
    # inputs themselves were checked above; the clip search is discrete, so
    # rounding-level differences in X^T X may pick other clips)
    for c in cands[1:]:
        ad.set(site.path, build_layer(orig, c, None, (H, n)))
        kl = float(np.array(kl_per_token(ref, model(mx.array(toks))), dtype=np.float64).mean())
        ad.set(site.path, orig)
        assert res.kl[c.name] == pytest.approx(kl, rel=1e-3)
    assert res.kl["2b_g64+gptq"] < res.kl["2b_g64"]
    assert res.kl["2b_g64+search"] < res.kl["2b_g64"]


def test_calibrated_allocation_quantizes_to_what_was_measured(tmp_path):
    import mixbits
    from mixbits.cli import main
    from mixbits.commands.quantize import allocation_candidates, quantize_candidates

    model, cfg = tiny_models.build("qwen3")
    mixbits.save(model, tmp_path / "m", cfg)
    toks = np.random.default_rng(1).integers(0, 160, (3, 16))
    np.save(tmp_path / "t.npy", toks)
    m, t = str(tmp_path / "m"), str(tmp_path / "t.npy")
    table = tmp_path / "table.json"
    assert main(["measure", "--model", m, "--tokens", t, "--candidates", "2b_g64", "2b_g64+gptq",
                 "4b_g64", "3b25_2b_g64+gptq", "--out", str(table)]) == 0
    entries = json.loads(table.read_text())["entries"]
    lin = [e for e in entries if "layers" in e["path"]]
    mean = {k: np.mean([c["kl"] for e in lin for c in e["candidates"] if c["kind"] == k])
            for k in ("2b_g64", "2b_g64+gptq")}
    assert mean["2b_g64+gptq"] < mean["2b_g64"]
    alloc = tmp_path / "alloc.json"
    assert main(["allocate", str(table), "--bpw", "3.2", "--out", str(alloc), "--quiet"]) == 0
    kinds = {e["kind"] for e in json.loads(alloc.read_text())["assignment"]}
    assert kinds & {"2b_g64+gptq", "3b25_2b_g64+gptq"}
    assert main(["quantize", "--model", m, "--allocation", str(alloc), "--out", str(tmp_path / "no")]) == 2
    assert main(["quantize", "--model", m, "--allocation", str(alloc), "--tokens", t,
                 "--out", str(tmp_path / "q")]) == 0
    loaded, _, _ = mixbits.load(tmp_path / "q")
    ref_model, _, _ = mixbits.load(m)
    from types import SimpleNamespace

    from mixbits.measure.calib import load_model

    measured, _ = load_model(SimpleNamespace(model=m))  # the layer inputs as measure saw them
    quantize_candidates(ref_model, allocation_candidates(alloc, ref_model), tokens=toks, measured=measured)
    x = mx.array(toks)
    np.testing.assert_array_equal(np.array(loaded(x)), np.array(ref_model(x)))


def test_quantize_dtype_is_the_dtype_its_layer_inputs_run_in(tmp_path):
    # `mixbits quantize --dtype` runs the model whose forward gives the
    # calibrated layers' inputs in that dtype, as measure --dtype ran it:
    # the folder equals quantize_candidates with that twin, and differs
    # from the float32 one.
    from types import SimpleNamespace

    import mixbits
    from mixbits.cli import main
    from mixbits.commands.quantize import allocation_candidates, quantize_candidates
    from mixbits.formats.allocation import Allocation, AllocationEntry
    from mixbits.measure.calib import load_model

    model, cfg = tiny_models.build("llama")
    m = str(tmp_path / "m")
    mixbits.save(model, m, cfg)
    toks = np.random.default_rng(0).integers(0, 160, (2, 16))
    np.save(tmp_path / "t.npy", toks)
    ad = ModelAdapter(model)
    entries = [AllocationEntry(s.path, s.block, s.nparams, 3, "3b_g32+search", 0.0, {}) for s in ad.sites]
    alloc = tmp_path / "alloc.json"
    Allocation.from_entries(entries).save(alloc)
    outs = {}
    for dt in ("float32", "bfloat16"):
        assert main(["quantize", "--model", m, "--allocation", str(alloc), "--tokens", str(tmp_path / "t.npy"),
                     "--dtype", dt, "--out", str(tmp_path / dt)]) == 0
        outs[dt] = np.array(mixbits.load(tmp_path / dt)[0](mx.array(toks)))
        ref = mixbits.load(m)[0]
        twin, _ = load_model(SimpleNamespace(model=m, dtype=dt))
        quantize_candidates(ref, allocation_candidates(alloc, ref), tokens=toks, measured=twin)
        np.testing.assert_array_equal(outs[dt], np.array(ref(mx.array(toks))))
    assert not np.array_equal(outs["float32"], outs["bfloat16"])
