"""--embed-bits and allocation.json's embed_bits (issue 43, item 5):

- embed_bits is always what was chosen: the width refine/allocate gave
  the embeddings and head inside the budget, or --embed-bits N when they
  were set apart at N bits outside it;
- quantize stores the embeddings and head an allocation does not assign
  at its embed_bits (ExLlamaV2-derived allocations rely on this);
- refine's joint KL is the KL of the model quantize writes: pinned layers
  (the model's own quant_predicate: MoE gates at 8 bits) and embeddings
  at --embed-bits included.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from mixbits.adapter import ModelAdapter
from mixbits.commands.quantize import allocation_candidates, quantize_candidates
from mixbits.formats.allocation import Allocation
from mixbits.measure.joint import JointEvaluator
from mixbits.measure.refine import allocate_table, refine
from mixbits.measure.sweep import kl_per_token, sweep

CANDS = ["3b_g64", "4b_g64", "8b_g64"]


def _tokens(n=2, seq=16):
    return np.random.default_rng(0).integers(0, 160, (n, seq))


@pytest.fixture(scope="module")
def llama_table(tmp_path_factory):
    model, cfg = tiny_models.build("llama")  # untied: embedding and head are two tensors
    return sweep(model, _tokens(), tmp_path_factory.mktemp("t") / "t.json", CANDS, progress=False)


def _outside(alloc):
    return [a for a in alloc["assignment"] if a.get("layer") is None]


def _real_kl(model, tokens, ref):
    """KL of the model as it is now against reference logits: numpy mean."""
    kl = kl_per_token(ref, model(mx.array(tokens)))
    return float(np.array(kl, dtype=np.float64).mean())


def test_refine_embed_bits_is_the_chosen_width(llama_table):
    model, _ = tiny_models.build("llama")
    ev = JointEvaluator(model, _tokens(), chunk=2)
    out = refine(llama_table, ev, 4.5, max_evals=2, progress=False, check_baselines=False)
    outside = _outside(out)
    assert {a["path"] for a in outside} == {"model.embed_tokens", "lm_head"}
    # here the embedding got 4 bits and the head 8: no one width to state
    assert sorted(a["bits"] for a in outside) == [4, 8] and out["embed_bits"] is None
    # 4b_g64 and 8b_g64 only, 4.5 storage bpw: every tensor at 4 bits
    only = {**llama_table, "entries": [
        {**e, "candidates": [c for c in e["candidates"] if c["kind"] != "3b_g64"]}
        for e in llama_table["entries"]]}
    out = refine(only, ev, 4.5, max_evals=2, progress=False, check_baselines=False)
    assert {a["bits"] for a in _outside(out)} == {4} and out["embed_bits"] == 4


def test_refine_embed_bits_sets_them_apart_and_evaluates_them(llama_table):
    model, _ = tiny_models.build("llama")
    toks = _tokens()
    ev = JointEvaluator(model, toks, chunk=2)
    out = refine(llama_table, ev, 3.5, max_evals=3, progress=False, check_baselines=False,
                 embed_bits=8)
    assert out["embed_bits"] == 8 and not _outside(out)
    # the allocation's tensors are the blocks' only: their bpw, not diluted by 8-bit embeddings
    assert out["average_bpw_storage"] <= 3.5
    # the joint KL refine reports is the KL of what quantize writes from it
    ref = model(mx.array(toks))
    alloc = Allocation.from_dict(out)
    chosen = allocation_candidates(alloc, model)
    quantize_candidates(model, chosen, embed_bits=alloc.embed_bits)
    assert type(ModelAdapter(model).get("model.embed_tokens")).__name__ != "Embedding"
    assert out["joint_refine"]["joint_kl_after"] == pytest.approx(_real_kl(model, toks, ref), rel=1e-5)


def test_allocate_cli_embed_bits(llama_table, tmp_path):
    from mixbits.cli import main

    (tmp_path / "t.json").write_text(json.dumps(llama_table))
    assert main(["allocate", str(tmp_path / "t.json"), "--bpw", "4.5", "--out", str(tmp_path / "a.json"),
                 "--quiet"]) == 0
    inside = json.loads((tmp_path / "a.json").read_text())
    widths = {a["bits"] for a in _outside(inside)}
    assert widths == {4, 8} and "embed_bits" not in inside  # two widths: none stated (was 8)
    assert main(["allocate", str(tmp_path / "t.json"), "--bpw", "3.5", "--embed-bits", "6",
                 "--out", str(tmp_path / "b.json"), "--quiet"]) == 0
    apart = json.loads((tmp_path / "b.json").read_text())
    assert apart["embed_bits"] == 6 and not _outside(apart)


def test_quantize_honours_embed_bits(llama_table, tmp_path):
    """An allocation without the embeddings and head (ExLlamaV2-derived,
    embed_bits 8): quantize stores them at 8 bits; --embed-bits overrides."""
    from mixbits.cli import main

    import mixbits

    model, cfg = tiny_models.build("llama")
    mixbits.save(model, tmp_path / "float", cfg)
    alloc, _, _ = allocate_table(llama_table, 4.5, embed_bits=8)
    assert alloc["embed_bits"] == 8 and not _outside(alloc)
    Allocation.from_dict(alloc).save(tmp_path / "a.json")
    for flag, bits in (([], 8), (["--embed-bits", "4"], 4), (["--embed-bits", "16"], None)):
        out = tmp_path / f"q{bits}"
        assert main(["quantize", "--model", str(tmp_path / "float"), "--allocation",
                     str(tmp_path / "a.json"), "--out", str(out), *flag]) == 0
        q, _, _ = mixbits.load(out)
        for path in ("model.embed_tokens", "lm_head"):
            m = ModelAdapter(q).get(path)
            if bits is None:
                assert type(m).__name__ in ("Embedding", "Linear"), (path, flag, m)
            else:  # one segment, N bits (MLX's own class or mixbits' with its layout)
                assert getattr(m, "bits", None) == bits or f"[{bits}b/g64x64]" in repr(m), (path, flag, m)


def test_joint_kl_includes_pinned_layers():
    """qwen3_moe pins its router gates at 8 bits (quant_predicate): the
    joint KL must be the KL of the model with the gates quantized too."""
    model, _ = tiny_models.build("qwen3_moe")
    adapter = ModelAdapter(model)
    assert adapter.fixed
    toks = _tokens()
    ev = JointEvaluator(model, toks, chunk=2)
    assignment = {s.path: "4b_g64" for s in adapter.sites}
    kl = ev.joint_kl(assignment)[0]
    ref = model(mx.array(toks))
    from mixbits.measure.candidates import parse_candidate

    quantize_candidates(model, {p: parse_candidate(c) for p, c in assignment.items()})
    assert kl == pytest.approx(_real_kl(model, toks, ref), rel=1e-5)
