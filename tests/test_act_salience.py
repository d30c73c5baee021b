"""``+act``: a mixed kind whose wide segment takes the columns with the
largest input energy x weight-column energy (calibration statistics), not
the largest weight norms alone."""

import json

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from mixbits.measure.candidates import build_layer, parse_candidate, supports
from mixbits.nn import MixedQuantizedLinear


def test_codec():
    c = parse_candidate("4b10_3b_g64+act")
    assert (c.kind, c.quantizer, c.calibrated, c.nominal_bits) == ("mixed", "act", True, 3.1)
    for name in ("3b_g64+act", "ternary_g64+act"):
        with pytest.raises(ValueError, match=r"\+act only orders a mixed kind"):
            parse_candidate(name)
    model, _ = tiny_models.build("llama")
    from mixbits.adapter import ModelAdapter

    sites = ModelAdapter(model).sites
    assert {(s.form, s.block is not None) for s in sites if supports(c, s)} == {("linear", True)}
    with pytest.raises(ValueError, match="needs the layer input"):
        build_layer(model.layers[0].mlp.down_proj, c)


def _planted(rng, n=48, k=512, loud=(7, 100, 300, 401, 450), quiet_big=(3, 50, 200, 333, 480)):
    """Weights where the large-norm columns see almost no input and a few
    small-norm columns see outlier inputs (x30): weight norms alone put the
    wrong columns in the wide segment."""
    w = rng.normal(size=(n, k)).astype(np.float32)
    w[:, list(loud)] *= 0.3
    w[:, list(quiet_big)] *= 4.0
    x = rng.normal(size=(256, k)).astype(np.float32)
    x[:, list(loud)] *= 30.0
    x[:, list(quiet_big)] *= 0.01
    return w, x, set(loud), set(quiet_big)


def _output_error(layer, w, x) -> float:
    """||x W^T - x W_q^T|| in float64, W_q from MLX's own dequantize of the
    stored segments (original column order)."""
    qt = layer.quantized_tensor()
    wq = np.array(qt.dequantize(unpermute=True, dtype=mx.float32), dtype=np.float64)
    return float(np.linalg.norm(x.astype(np.float64) @ (w.astype(np.float64) - wq).T))


def test_act_puts_the_loud_columns_in_the_wide_segment_and_lowers_the_output_error():
    rng = np.random.default_rng(0)
    w, x, loud, quiet_big = _planted(rng)
    import mlx.nn as nn

    base = nn.Linear(w.shape[1], w.shape[0], bias=False)
    base.weight = mx.array(w)
    h = x.astype(np.float64).T @ x.astype(np.float64)
    rtn = build_layer(base, parse_candidate("4b10_2b_g64"))
    act = build_layer(base, parse_candidate("4b10_2b_g64+act"), None, (h, x.shape[0]))
    k_hi = act.quantized_tensor().segments[0].k
    assert k_hi == 64
    wide_act = set(np.array(act.quantized_tensor().perm)[:k_hi].tolist())
    wide_rtn = set(np.array(rtn.quantized_tensor().perm)[:k_hi].tolist())
    assert loud <= wide_act and not (quiet_big & wide_act)
    assert quiet_big <= wide_rtn and not (loud & wide_rtn)
    # the ranking itself, from the inputs directly (not from X^T X)
    energy = (x.astype(np.float64) ** 2).mean(axis=0) * (w.astype(np.float64) ** 2).sum(axis=0)
    assert wide_act == set(np.argsort(-energy)[:k_hi].tolist())
    e_act, e_rtn = _output_error(act, w, x), _output_error(rtn, w, x)
    print(f"output error, +act / weight-norm order: {e_act / e_rtn:.3f}")
    assert e_act < 0.8 * e_rtn, (e_act, e_rtn)
    assert isinstance(act, MixedQuantizedLinear)


def test_measured_act_candidate_is_what_quantize_saves(tmp_path):
    import mixbits
    from mixbits.cli import main
    from mixbits.commands.quantize import allocation_candidates, quantize_candidates

    model, cfg = tiny_models.build("llama")
    mixbits.save(model, tmp_path / "m", cfg)
    toks = np.random.default_rng(2).integers(0, 160, (3, 16))
    np.save(tmp_path / "t.npy", toks)
    m, t = str(tmp_path / "m"), str(tmp_path / "t.npy")
    table = tmp_path / "table.json"
    assert main(["measure", "--model", m, "--tokens", t, "--candidates", "2b_g64", "4b_g64",
                 "3b25_2b_g64+act", "--out", str(table)]) == 0
    entries = json.loads(table.read_text())["entries"]
    assert all(any(c["kind"] == "3b25_2b_g64+act" for c in e["candidates"])
               for e in entries if "layers" in e["path"])
    alloc = tmp_path / "alloc.json"
    assert main(["allocate", str(table), "--bpw", "2.9", "--out", str(alloc), "--quiet"]) == 0
    assert "3b25_2b_g64+act" in {e["kind"] for e in json.loads(alloc.read_text())["assignment"]}
    assert main(["quantize", "--model", m, "--allocation", str(alloc), "--tokens", t,
                 "--out", str(tmp_path / "q")]) == 0
    loaded, _, _ = mixbits.load(tmp_path / "q")
    ref_model, _, _ = mixbits.load(m)
    quantize_candidates(ref_model, allocation_candidates(alloc, ref_model), tokens=toks)
    x = mx.array(toks)
    np.testing.assert_array_equal(np.array(loaded(x)), np.array(ref_model(x)))
