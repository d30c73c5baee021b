"""measure -> refine -> quantize -> mixbits.load with every kind: each
bit width, each group size, ternary and a mixed-segment kind. The saved
layers carry exactly the segments, kinds, group sizes and permutation the
allocation names, and the loaded model's logits equal the model quantized
in memory from the same allocation."""

import json

import mlx.core as mx
import numpy as np

import mixbits
import tiny_models
from mixbits.cli import main
from mixbits.commands.quantize import allocation_candidates, quantize_candidates
from mixbits.formats.allocation import Allocation, AllocationEntry
from mixbits.measure.candidates import parse_candidate

# Tiny llama: K = 64 everywhere except down_proj (K = 128), so g128 fits
# only there; the mixed kind puts one group of 32 columns at 4 bits.
KINDS = ["2b_g32", "3b_g64", "4b_g32", "5b_g64", "6b_g32", "8b_g64", "4b_g128", "ternary_g32",
         "4b25_2b_g32"]


def _layout(layer):
    qt = layer.quantized_tensor()
    segs = [(s.bits if s.kind == "affine" else "ternary", s.group_size, s.k) for s in qt.segments]
    return segs, qt.perm is not None


def _expected(kind: str, k: int):
    c = parse_candidate(kind)
    return [tuple(s) for s in c.segments(k)], c.kind == "mixed"


def _check_folder(folder, alloc_path, ref_model, toks):
    loaded, _, _ = mixbits.load(folder)
    modules = dict(loaded.named_modules())
    alloc = Allocation.load(alloc_path)
    seen = set()
    for e in alloc.assignment:
        layer = modules[e.path]
        k = layer.quantized_tensor().shape[-1]
        assert _layout(layer) == _expected(e.kind, k), e.path
        seen.add(e.kind)
    quantize_candidates(ref_model, allocation_candidates(alloc_path, ref_model), tokens=toks)
    x = mx.array(toks)
    np.testing.assert_array_equal(np.array(loaded(x)), np.array(ref_model(x)))
    return seen


def test_every_kind_from_measure_to_load(tmp_path):
    model, cfg = tiny_models.build("llama")
    mixbits.save(model, tmp_path / "m", cfg)
    toks = np.random.default_rng(0).integers(0, 160, (2, 16))
    np.save(tmp_path / "t.npy", toks)
    m, t = str(tmp_path / "m"), str(tmp_path / "t.npy")
    table_path = tmp_path / "table.json"
    assert main(["measure", "--model", m, "--tokens", t, "--candidates", *KINDS,
                 "--out", str(table_path)]) == 0
    table = json.loads(table_path.read_text())
    measured = {c["kind"] for e in table["entries"] for c in e["candidates"]}
    assert measured == set(KINDS)

    # refine's own choice at a budget, through quantize and load
    refined = tmp_path / "refined.json"
    assert main(["refine", str(table_path), "--model", m, "--tokens", t, "--bpw", "4.2",
                 "--max-evals", "3", "--out", str(refined)]) == 0
    assert main(["quantize", "--model", m, "--allocation", str(refined), "--out",
                 str(tmp_path / "q1")]) == 0
    _check_folder(tmp_path / "q1", refined, mixbits.load(m)[0], toks)

    # every kind at least once: the measured entries, kinds taken in turn;
    # the first down_proj takes 4b_g128, the one tensor shape it fits
    entries, g128_given = [], False
    for i, e in enumerate(table["entries"]):
        cands = e["candidates"]
        c = cands[i % len(cands)]
        if not g128_given and any(x["kind"] == "4b_g128" for x in cands):
            c, g128_given = next(x for x in cands if x["kind"] == "4b_g128"), True
        entries.append(AllocationEntry(e["path"], e.get("layer"), e["nparams"], c["bits"], c["kind"],
                                       c["kl"], {"storage_bits": c["storage_bits"]}))
    every = tmp_path / "every.json"
    Allocation.from_entries(entries).save(every)
    assert main(["quantize", "--model", m, "--allocation", str(every), "--out",
                 str(tmp_path / "q2")]) == 0
    seen = _check_folder(tmp_path / "q2", every, mixbits.load(m)[0], toks)
    assert seen == set(KINDS), set(KINDS) - seen
