import json

import pytest

pytest.importorskip("matplotlib")

from mixbits.cli import main  # noqa: E402


def _table():
    entries = []
    for layer in range(3):
        for kind in ("q_proj", "down_proj"):
            entries.append({"path": f"model.layers.{layer}.mlp.{kind}", "layer": layer, "nparams": 10,
                            "candidates": [{"kind": "2b_g64", "bits": 2, "kl": 0.1 * (layer + 1)},
                                           {"kind": "4b_g64", "bits": 4, "kl": 0.0}]})
    return {"format": "mixbits.sensitivity", "version": 1, "entries": entries}


def test_plot_writes_png(tmp_path):
    t = tmp_path / "t.json"
    t.write_text(json.dumps(_table()))
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"average_bits": 3.0, "assignment": [
        {"path": e["path"], "bits": 2 + 2 * (i % 2)} for i, e in enumerate(_table()["entries"])]}))
    out = tmp_path / "f.png"
    assert main(["plot", str(t), "--out", str(out), "--allocation", str(a)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_plot_rejects_non_table(tmp_path, capsys):
    t = tmp_path / "t.json"
    t.write_text('{"entries": 3}')
    assert main(["plot", str(t), "--out", str(tmp_path / "f.png")]) == 2
    assert "not a sensitivity table" in capsys.readouterr().err
    t.write_text('{"entries": [')
    assert main(["plot", str(t), "--out", str(tmp_path / "f.png")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert not (tmp_path / "f.png").exists()


# ------------------------------------------------ arguments and inputs checked first


def test_out_without_suffix_is_written_to_exactly_that_name(tmp_path, capsys):
    t = tmp_path / "t.json"
    t.write_text(json.dumps(_table()))
    out = tmp_path / "figure"
    assert main(["plot", str(t), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "figure.png").exists()
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    svg = tmp_path / "f.svg"
    assert main(["plot", str(t), "--out", str(svg)]) == 0 and b"<svg" in svg.read_bytes()[:400]


def test_table_without_candidates_is_one_line(tmp_path, capsys):
    raw = _table()
    del raw["entries"][0]["candidates"]
    t = tmp_path / "t.json"
    t.write_text(json.dumps(raw))
    assert main(["plot", str(t), "--out", str(tmp_path / "f.png")]) == 2
    err = capsys.readouterr().err
    assert "missing key 'candidates'" in err and len(err.strip().splitlines()) == 1


def test_allocation_of_another_model_is_refused(tmp_path, capsys):
    t = tmp_path / "t.json"
    t.write_text(json.dumps(_table()))
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"assignment": [{"path": "model.layers.40.self_attn.q_proj", "bits": 4}]}))
    assert main(["plot", str(t), "--out", str(tmp_path / "f.png"), "--allocation", str(a)]) == 2
    assert "another model" in capsys.readouterr().err
    assert not (tmp_path / "f.png").exists()


def test_plot_shows_kinds_of_one_width(tmp_path):
    """mxfp4 and 4b_g64 are both 4 bits: the allocation panel then shows
    the chosen kinds, one colour each, not the width."""
    from mixbits.measure.plot import _chosen_kinds

    t = tmp_path / "t.json"
    t.write_text(json.dumps(_table()))
    kinds = ["mxfp4", "4b_g64", "nvfp4"]
    assignment = [{"path": e["path"], "bits": 4, "kind": kinds[i % 3]}
                  for i, e in enumerate(_table()["entries"])]
    assert _chosen_kinds(assignment) == ["4b_g64", "mxfp4", "nvfp4"]
    assert _chosen_kinds([{**a, "bits": 2 + i} for i, a in enumerate(assignment[:3])]) is None
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"average_bits": 4.0, "assignment": assignment}))
    out = tmp_path / "f.png"
    assert main(["plot", str(t), "--out", str(out), "--allocation", str(a)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
