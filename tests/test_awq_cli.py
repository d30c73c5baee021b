"""``--awq`` on measure and quantize: the saved folder is the in-memory
pipeline (scale_model, then the allocation's candidates) and differs from
the same allocation without AWQ; bad values fail before the model loads."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import mixbits
import tiny_models
from mixbits.cli import main
from mixbits.commands.quantize import allocation_candidates, quantize_candidates
from mixbits.measure.awq_scale import scale_model
from test_awq_scale import plant_outliers


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("awq")
    model, cfg = tiny_models.build("llama")
    plant_outliers(model, offset=False)
    mixbits.save(model, d / "model", cfg)
    np.save(d / "tokens.npy", np.random.default_rng(3).integers(0, 160, (4, 24)))
    return d


def test_measure_and_quantize_with_awq_match_the_in_memory_pipeline(folder, tmp_path, capsys):
    m, t = str(folder / "model"), str(folder / "tokens.npy")
    table, alloc = tmp_path / "table.json", tmp_path / "alloc.json"
    assert main(["measure", "--model", m, "--tokens", t, "--candidates", "2b_g32", "4b_g32",
                 "--method", "grad", "--awq", "3b_g32", "--out", str(table)]) == 0
    assert "awq 3b_g32: scaled" in capsys.readouterr().out
    assert main(["allocate", str(table), "--bpw", "3.2", "--out", str(alloc), "--quiet"]) == 0
    out, plain = tmp_path / "q", tmp_path / "plain"
    assert main(["quantize", "--model", m, "--allocation", str(alloc), "--tokens", t,
                 "--awq", "3b_g32", "--out", str(out)]) == 0
    assert main(["quantize", "--model", m, "--allocation", str(alloc), "--out", str(plain)]) == 0
    x = mx.array(np.load(folder / "tokens.npy"))
    loaded, _, _ = mixbits.load(out)
    ref, _, _ = mixbits.load(m)
    scale_model(ref, np.load(folder / "tokens.npy"), 3, 32, progress=False)
    quantize_candidates(ref, allocation_candidates(json.loads(alloc.read_text()), ref))
    np.testing.assert_array_equal(np.array(loaded(x)), np.array(ref(x)))
    without, _, _ = mixbits.load(plain)
    assert not np.allclose(np.array(loaded(x)), np.array(without(x)), atol=1e-3)


@pytest.mark.parametrize("extra, msg", [
    (["--awq", "4b10_3b_g64", "--tokens", "T"], "uniform round-to-nearest kind"),
    (["--awq", "3b_g64+gptq", "--tokens", "T"], "uniform round-to-nearest kind"),
    (["--awq", "3b_g64"], "--awq needs the calibration tokens"),
])
def test_quantize_refuses_bad_awq_before_loading(folder, tmp_path, capsys, extra, msg):
    alloc = tmp_path / "a.json"
    alloc.write_text(json.dumps({"average_bits": 3.0, "assignment": []}))
    extra = [str(folder / "tokens.npy") if e == "T" else e for e in extra]
    rc = main(["quantize", "--model", str(tmp_path / "no-model"), "--allocation", str(alloc),
               "--out", str(tmp_path / "o"), *extra])
    assert rc == 2
    assert msg in capsys.readouterr().err


def test_measure_refuses_bad_awq_before_loading(tmp_path, capsys):
    rc = main(["measure", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "t.json"),
               "--awq", "ternary_g64"])
    assert rc == 2
    assert "uniform round-to-nearest kind" in capsys.readouterr().err
