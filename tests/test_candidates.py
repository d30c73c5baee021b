"""Candidate names and presets: one codec for every command."""

import pytest

from mixbits.measure.candidates import PRESETS, expand_candidates, parse_candidate


def test_presets_expand_in_order_without_repeats():
    wide = expand_candidates(["wide"])
    assert {"5b_g64", "6b_g128", "2b_g128", "8b_g64", "ternary_g64"} <= set(wide)
    assert len(wide) == len(set(wide)) == len(PRESETS["wide"])
    both = expand_candidates(["4b_g64", "default", "wide"])
    assert both[0] == "4b_g64" and both.count("4b_g64") == 1
    with pytest.raises(ValueError, match="bits must be one of"):
        expand_candidates(["default", "9b_g64"])
    with pytest.raises(ValueError, match="unknown candidate"):
        expand_candidates(["widest"])


@pytest.mark.parametrize("name,nominal,segs", [
    ("5b_g32", 5, [(5, 32, 256)]),
    ("ternary_g128", 2, [("ternary", 128, 256)]),
    ("6b10_4b_g64", 4.2, [(6, 64, 64), (4, 64, 192)]),  # 10% of 256 rounds to one group
])
def test_codec(name, nominal, segs):
    c = parse_candidate(name)
    assert c.nominal_bits == pytest.approx(nominal)
    assert c.segments(256) == segs


def test_measure_cli_takes_a_preset(tmp_path):
    import json

    import mixbits
    import numpy as np
    import tiny_models
    from mixbits.cli import main

    model, cfg = tiny_models.build("qwen3")
    mixbits.save(model, tmp_path / "m", cfg)
    np.save(tmp_path / "t.npy", np.random.default_rng(0).integers(0, 160, (2, 8)))
    out = tmp_path / "table.json"
    assert main(["measure", "--model", str(tmp_path / "m"), "--tokens", str(tmp_path / "t.npy"),
                 "--candidates", "wide", "--tensors", "model.layers.1.mlp.down_proj",
                 "--out", str(out)]) == 0
    t = json.loads(out.read_text())
    assert t["meta"]["candidates"] == list(PRESETS["wide"])
    # K = 128 (intermediate): every candidate fits
    assert [c["kind"] for c in t["entries"][0]["candidates"]] == list(PRESETS["wide"])
