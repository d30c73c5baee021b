"""measure -> refine -> quantize -> load with MLX's fp modes mixed with
affine kinds in one allocation. Every method (exact, grad, two-stage)
measures the fp candidates; a forced mix (mxfp4, nvfp4, mxfp8 and affine
tensors side by side) is saved as MLX's own quantized layers with
per-layer ``mode`` entries, so stock mlx-lm loads the folder, with the
logits of ``mixbits.load`` (and of ``mixbits.load(patch=True)``, which
leaves the fp layers to MLX)."""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mixbits
import tiny_models
from mixbits.cli import main
from mixbits.formats.allocation import Allocation, AllocationEntry

CANDS = ["3b_g64", "4b_g64", "mxfp4", "nvfp4", "mxfp8"]
FP = {"mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp")
    model, cfg = tiny_models.build("llama")
    mixbits.save(model, tmp / "m", cfg)
    toks = np.random.default_rng(0).integers(0, 160, (2, 16))
    np.save(tmp / "t.npy", toks)
    return tmp, str(tmp / "m"), str(tmp / "t.npy"), toks


@pytest.mark.parametrize("method", ["exact", "grad", "two-stage"])
def test_every_method_measures_fp(setup, method):
    tmp, m, t, _ = setup
    out = tmp / f"{method}.json"
    extra = ["--targets", "4.4", "5"] if method == "two-stage" else []
    assert main(["measure", "--model", m, "--tokens", t, "--candidates", "3b_g64", "4b_g64", "fp",
                 "--method", method, *extra, "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    for e in table["entries"]:
        got = {c["kind"]: c for c in e["candidates"]}
        assert set(got) == set(CANDS), e["path"]
        for mode, (gs, bits) in FP.items():
            c = got[mode]
            # storage as stored: codes plus one uint8 scale per group
            assert c["storage_bits"] == e["nparams"] * bits + e["nparams"] // gs * 8
            assert np.isfinite(c["kl"]) and c["kl"] >= 0
            assert c["group_size"] == gs
        # finer steps cost less: mxfp8 below every 4-bit kind on each tensor
        assert got["mxfp8"]["kl"] < min(got[k]["kl"] for k in ("mxfp4", "nvfp4", "4b_g64"))


def _forced(table_path, out):
    """An allocation giving the tensors mxfp4, nvfp4, mxfp8 and affine kinds
    in turn (the embedding nvfp4: the one tensor kind each mode reaches)."""
    table = json.loads(Path(table_path).read_text())
    order = ["mxfp4", "nvfp4", "4b_g64", "mxfp8", "3b_g64"]
    entries = []
    for i, e in enumerate(table["entries"]):
        have = {c["kind"]: c for c in e["candidates"]}
        turn = [k for k in order[i % len(order):] + order if k in have]  # this turn's kind, or the next measured
        kind = "nvfp4" if e["path"].endswith("embed_tokens") else turn[0]
        c = have[kind]
        entries.append(AllocationEntry(e["path"], e.get("layer"), e["nparams"], c["bits"], c["kind"],
                                       c["kl"], {"storage_bits": c["storage_bits"]}))
    Allocation.from_entries(entries).save(out)
    return {e.path: e.kind for e in entries}


def _f64(a):
    return np.array(a.astype(mx.float32), dtype=np.float64)


def test_forced_mix_loads_in_mlx_lm(setup):
    from mlx_lm.utils import load_model

    tmp, m, t, toks = setup
    table = tmp / "exact.json"
    if not table.exists():
        assert main(["measure", "--model", m, "--tokens", t, "--candidates", *CANDS,
                     "--out", str(table)]) == 0
    kinds = _forced(table, tmp / "forced.json")
    assert {"mxfp4", "nvfp4", "mxfp8", "4b_g64", "3b_g64"} <= set(kinds.values())
    q = tmp / "q"
    assert main(["quantize", "--model", m, "--allocation", str(tmp / "forced.json"), "--out", str(q)]) == 0

    cfg = json.loads((q / "config.json").read_text())
    assert "model_file" not in cfg  # nothing only mixbits reads: stock mlx-lm runs it
    quant = cfg["quantization"]
    for path, kind in kinds.items():
        mode = kind if kind in FP else "affine"
        gs, bits = FP[kind] if kind in FP else (64, int(kind[0]))
        assert quant[path] == {"group_size": gs, "bits": bits, "mode": mode}, path

    stock, _ = load_model(q)
    ours, _, _ = mixbits.load(q)
    patched, _, _ = mixbits.load(q, patch=True)
    mods = {"stock": dict(stock.named_modules()), "ours": dict(ours.named_modules()),
            "patched": dict(patched.named_modules())}
    for path, kind in kinds.items():
        if kind in FP:  # MLX's own layer in every loader, patch included
            for name, mm in mods.items():
                assert mm[path].mode == kind and isinstance(mm[path], (nn.QuantizedLinear, nn.QuantizedEmbedding)), (name, path)
        else:
            assert type(mods["patched"][path]).__name__.startswith("MixedQuantized"), path
    x = mx.array(toks)
    want = _f64(stock(x))
    scale = np.abs(want).max()
    # affine layers run mixbits' kernel in mixbits' loaders: float32 rounding apart
    for got in (ours(x), patched(x)):
        assert np.abs(_f64(got) - want).max() <= 1e-5 * scale

    # The stored fp layers are mx.quantize of the float model's weights.
    src, _, _ = mixbits.load(m)
    srcm = dict(src.named_modules())
    for path, kind in kinds.items():
        if kind in FP:
            wq, s = mx.quantize(srcm[path].weight, *FP[kind], mode=kind)
            assert mx.array_equal(mods["stock"][path]["weight"], wq).item()
            assert mx.array_equal(mods["stock"][path]["scales"], s).item()


def test_refine_and_plot_over_the_mixed_menu(setup):
    pytest.importorskip("matplotlib")
    tmp, m, t, toks = setup
    table = tmp / "exact.json"
    if not table.exists():
        assert main(["measure", "--model", m, "--tokens", t, "--candidates", *CANDS,
                     "--out", str(table)]) == 0
    refined = tmp / "refined.json"
    assert main(["refine", str(table), "--model", m, "--tokens", t, "--bpw", "4.4",
                 "--max-evals", "3", "--out", str(refined)]) == 0
    alloc = json.loads(refined.read_text())
    assert alloc["average_bpw_storage"] <= 4.4 + 1e-9
    assert main(["quantize", "--model", m, "--allocation", str(refined), "--out", str(tmp / "r")]) == 0
    loaded, _, _ = mixbits.load(tmp / "r")
    assert np.isfinite(_f64(loaded(mx.array(toks)))).all()
    png = tmp / "p.png"
    assert main(["plot", str(table), "--allocation", str(refined), "--out", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_fp_beside_mixbits_only_layers(setup):
    """A folder with a mixed-segment kind (only mixbits reads it: stock
    mlx-lm runs the folder through its model file, when trusted) and fp
    layers: mlx-lm builds the fp layers from their config entries, the
    model file places the mixbits ones, and the logits are mixbits.load's."""
    from mlx_lm.utils import load_model

    tmp, m, t, toks = setup
    table = tmp / "mixedkind.json"
    assert main(["measure", "--model", m, "--tokens", t, "--candidates", "4b25_2b_g32", "mxfp4", "nvfp4",
                 "--method", "grad", "--out", str(table)]) == 0
    entries, kinds = [], {}
    for i, e in enumerate(json.loads(table.read_text())["entries"]):
        c = e["candidates"][i % 3]
        kinds[e["path"]] = c["kind"]
        entries.append(AllocationEntry(e["path"], e.get("layer"), e["nparams"], c["bits"], c["kind"],
                                       c["kl"], {"storage_bits": c["storage_bits"]}))
    Allocation.from_entries(entries).save(tmp / "mk.json")
    q = tmp / "qmk"
    assert main(["quantize", "--model", m, "--allocation", str(tmp / "mk.json"), "--out", str(q)]) == 0
    assert "model_file" in json.loads((q / "config.json").read_text())
    stock, _ = load_model(q, trust_remote_code=True)
    ours, _, _ = mixbits.load(q)
    sm = dict(stock.named_modules())
    for path, kind in kinds.items():
        if kind in FP:
            assert type(sm[path]) in (nn.QuantizedLinear, nn.QuantizedEmbedding) and sm[path].mode == kind
        else:
            assert type(sm[path]).__name__.startswith("MixedQuantized"), path
    x = mx.array(toks)
    np.testing.assert_array_equal(_f64(stock(x)), _f64(ours(x)))


def test_fp_expert_stacks_load_in_mlx_lm(tmp_path):
    """An MoE's expert stacks at fp kinds are mlx-lm's QuantizedSwitchLinear
    in that mode, read back by stock mlx-lm from the per-layer entries."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear
    from mlx_lm.utils import load_model

    model, cfg = tiny_models.build("qwen3_moe")
    mixbits.save(model, tmp_path / "m", cfg)
    toks = np.random.default_rng(1).integers(0, 160, (2, 12))
    np.save(tmp_path / "t.npy", toks)
    m, t = str(tmp_path / "m"), str(tmp_path / "t.npy")
    table = tmp_path / "t.json"
    assert main(["measure", "--model", m, "--tokens", t, "--candidates", "4b_g64", "fp", "--method", "grad",
                 "--out", str(table)]) == 0
    kinds = _forced(table, tmp_path / "a.json")
    stacks = [p for p in kinds if "switch_mlp" in p]
    assert stacks and {kinds[p] for p in stacks} & set(FP)
    q = tmp_path / "q"
    assert main(["quantize", "--model", m, "--allocation", str(tmp_path / "a.json"), "--out", str(q)]) == 0
    stock, _ = load_model(q)
    ours, _, _ = mixbits.load(q, patch=True)
    sm, om = dict(stock.named_modules()), dict(ours.named_modules())
    for p in stacks:
        if kinds[p] in FP:
            assert type(sm[p]) is QuantizedSwitchLinear and sm[p].mode == kinds[p]
            assert type(om[p]) is QuantizedSwitchLinear and om[p].mode == kinds[p]
    x = mx.array(toks)
    want = _f64(stock(x))
    assert np.abs(_f64(ours(x)) - want).max() <= 1e-5 * np.abs(want).max()
