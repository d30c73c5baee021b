"""A table or allocation made for another model (same module paths, other
sizes) is refused by every command that also has the model, before any
work, naming the first mismatching tensor and both sizes. Before, refine
and compare accepted it and wrote an allocation carrying the other
model's nparams."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from mixbits.cli import main  # noqa: E402
from tiny_model import tiny_llama  # noqa: E402

TENSORS = ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.v_proj"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two models of one family (paths alike, the big one 2x wider), a table
    and an allocation measured on the big one."""
    import mixbits

    d = tmp_path_factory.mktemp("foreign")
    mixbits.save(tiny_llama(hidden=64), d / "small")
    mixbits.save(tiny_llama(hidden=128), d / "big")
    np.save(d / "tokens.npy", np.random.default_rng(3).integers(0, 200, (2, 16)))
    common = ["--tokens", str(d / "tokens.npy")]
    assert main(["measure", "--model", str(d / "big"), *common, "--tensors", *TENSORS,
                 "--candidates", "2b_g64", "4b_g64", "--out", str(d / "big_table.json")]) == 0
    assert main(["refine", str(d / "big_table.json"), "--model", str(d / "big"), *common,
                 "--bpw", "4", "--max-evals", "1", "--out", str(d / "big_alloc.json")]) == 0
    assert main(["measure", "--model", str(d / "small"), *common, "--tensors", *TENSORS,
                 "--candidates", "2b_g64", "4b_g64", "--out", str(d / "small_table.json")]) == 0
    return d


NEEDLE = ("was made for another model", "tensor model.layers.0.mlp.down_proj is 128x256 = 32768 "
          "there and 64x128 = 8192 in this model")


def _refused(capsys, needles=NEEDLE):
    err = capsys.readouterr().err
    assert all(n in err for n in needles), err


def test_refine_refuses_a_table_of_another_model(files, tmp_path, capsys):
    out = tmp_path / "a.json"
    assert main(["refine", str(files / "big_table.json"), "--model", str(files / "small"),
                 "--tokens", str(files / "tokens.npy"), "--bpw", "4", "--max-evals", "1",
                 "--out", str(out)]) == 2
    _refused(capsys)
    assert not out.exists()


def test_compare_refuses_a_table_of_another_model(files, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["compare", str(files / "big_table.json"), "--model", str(files / "small"),
                 "--tokens", str(files / "tokens.npy"), "--bpw", "4", "--max-evals", "1",
                 "--low", "2b_g64", "--high", "4b_g64", "--json", str(out)]) == 2
    _refused(capsys)
    assert not out.exists()


def test_quantize_refuses_before_any_work(files, tmp_path, capsys, monkeypatch):
    import mixbits.measure.awq_scale as awq

    def no_work(*a, **k):
        raise AssertionError("AWQ search started on an allocation of another model")

    monkeypatch.setattr(awq, "apply_awq", no_work)
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(files / "small"), "--allocation",
                 str(files / "big_alloc.json"), "--tokens", str(files / "tokens.npy"),
                 "--awq", "4b_g64", "--out", str(out)]) == 2
    _refused(capsys, ("--allocation", "was made for another model", "model.layers.0.mlp.down_proj",
                      "32768", "8192"))
    assert not out.exists()


def test_plot_refuses_an_allocation_of_another_model(files, tmp_path, capsys):
    out = tmp_path / "p.png"
    assert main(["plot", str(files / "small_table.json"), "--allocation",
                 str(files / "big_alloc.json"), "--out", str(out)]) == 2
    _refused(capsys, ("big_alloc.json was made for another model",
                      "model.layers.0.mlp.down_proj has 32768", "8192 in the table"))
    assert not out.exists()


def test_the_models_own_files_pass(files, tmp_path):
    from mixbits.measure.identity import check_made_for
    from mixbits.models import load

    model = load(str(files / "big"))[0]
    check_made_for(model, json.loads((files / "big_table.json").read_text())["entries"], "t")
    check_made_for(model, json.loads((files / "big_alloc.json").read_text())["assignment"], "a")
