"""The command-line pipeline on a model folder of a wrapped hybrid
architecture (qwen3_5 VLM layout: ``language_model.model.layers``, gated
delta-net blocks) without a tokenizer: measure --tokens -> allocate ->
refine -> quantize -> mixbits.load, plot and --exl2-out on the same paths."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from mixbits.cli import main


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import mixbits

    d = tmp_path_factory.mktemp("hybrid")
    model, cfg = tiny_models.build("qwen3_5_vlm")
    mixbits.save(model, d / "model", cfg)
    toks = np.random.default_rng(3).integers(0, 160, (3, 16))
    np.save(d / "tokens.npy", toks)
    (d / "tokens.json").write_text(json.dumps(toks.tolist()))
    return d


def test_pipeline_on_folder_without_tokenizer(folder, tmp_path):
    import mixbits
    from mixbits.commands.quantize import allocation_candidates, quantize_candidates

    m, t = str(folder / "model"), str(folder / "tokens.npy")
    table = tmp_path / "table.json"
    assert main(["measure", "--model", m, "--tokens", t, "--candidates", "2b_g32", "4b_g64",
                 "ternary_g64", "--out", str(table), "--exl2-out", str(tmp_path / "m.json")]) == 0
    entries = json.loads(table.read_text())["entries"]
    paths = {e["path"] for e in entries}
    assert "language_model.model.layers.0.linear_attn.in_proj_qkv" in paths
    assert "language_model.lm_head" in paths
    exl2 = json.loads((tmp_path / "m.json").read_text())["measurement"]
    assert "language_model.model.layers.0.linear_attn" in exl2
    assert "language_model.model.layers.1.self_attn" in exl2  # full-attention every 2nd block
    alloc = tmp_path / "alloc.json"
    assert main(["allocate", str(table), "--bpw", "3.6", "--out", str(alloc), "--quiet"]) == 0
    refined = tmp_path / "refined.json"
    assert main(["refine", str(table), "--model", m, "--tokens", str(folder / "tokens.json"),
                 "--bpw", "3.6", "--max-evals", "3", "--out", str(refined)]) == 0
    evolved = tmp_path / "evolved.json"
    assert main(["refine", str(table), "--model", m, "--tokens", str(folder / "tokens.json"),
                 "--bpw", "3.6", "--max-evals", "4", "--method", "evolve", "--out", str(evolved)]) == 0
    jr = json.loads(evolved.read_text())["joint_refine"]
    assert jr["method"] == "evolve" and jr["joint_kl_after"] <= jr["joint_kl_before"]
    # one budget meaning: allocate's default (storage bits) is refine's knapsack
    assert json.loads(alloc.read_text())["sum_kl"] == pytest.approx(
        json.loads(refined.read_text())["dp_sum_kl"])
    assert main(["plot", str(table), "--allocation", str(refined), "--out", str(tmp_path / "p.png")]) == 0
    out = tmp_path / "q"
    assert main(["quantize", "--model", m, "--allocation", str(refined), "--out", str(out)]) == 0
    loaded, tok, _ = mixbits.load(out)
    assert tok is None
    # the same allocation applied in memory, through the same constructor
    ref_model, _, _ = mixbits.load(m)
    quantize_candidates(ref_model, allocation_candidates(refined, ref_model))
    x = mx.array(np.load(folder / "tokens.npy"))
    np.testing.assert_array_equal(np.array(loaded(x)), np.array(ref_model(x)))


def test_measure_refuses_bad_arguments_before_loading(folder, tmp_path, capsys):
    bad_tokens = tmp_path / "bad.npy"
    np.save(bad_tokens, np.zeros((4,), dtype=np.int64))
    cases = [
        (["--tokens", str(bad_tokens)], "shape"),
        (["--n-seq", "0"], "--n-seq"),
        (["--seq-len", "1"], "--seq-len"),
        (["--candidates", "5bits"], "unknown candidate"),
        (["--max-batch", "0"], "--max-batch"),
        (["--text", str(tmp_path / "nope.txt")], "no such file"),
    ]
    for extra, msg in cases:
        # a model path that does not exist: only an argument check can answer first
        rc = main(["measure", "--model", str(tmp_path / "no-model"), "--out",
                   str(tmp_path / "t.json"), *extra])
        assert rc == 2
        assert msg in capsys.readouterr().err, extra
    big = tmp_path / "big.npy"
    np.save(big, np.full((2, 8), 10_000))
    assert main(["measure", "--model", str(folder / "model"), "--tokens", str(big),
                 "--out", str(tmp_path / "t.json")]) == 2
    assert "vocabulary" in capsys.readouterr().err


def test_readme_folder_example_runs_as_written(folder, tmp_path, monkeypatch):
    """The README's 'Any mlx-lm model' commands, on the tiny hybrid folder."""
    import re
    import shlex
    import shutil
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "path/to/mlx-model" in b)
    shutil.copytree(folder / "model", tmp_path / "path" / "to" / "mlx-model")
    shutil.copy(folder / "tokens.npy", tmp_path / "calib.npy")
    monkeypatch.chdir(tmp_path)
    lines = [ln.split("  #")[0].strip() for ln in block.strip().splitlines()]
    assert len(lines) == 3
    for line in lines:
        argv = shlex.split(line)
        assert argv[0] == "mixbits" and main(argv[1:]) == 0, line
    assert (tmp_path / "mlx-model-3.5bpw" / "config.json").is_file()
