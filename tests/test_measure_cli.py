"""`mixbits measure` and `refine` end to end on the real model,
restricted to a few tensors and tokens to stay fast."""

import json

import pytest

pytest.importorskip("mlx_lm")

from mixbits.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def smollm2():
    from mixbits.models import Unavailable, smollm2

    try:
        smollm2.fetch()
    except Unavailable as e:
        pytest.skip(f"SmolLM2 GGUF cannot be downloaded here: {e}")
    return "smollm2"


TENSORS = ["model.layers.0.self_attn.v_proj", "model.layers.29.mlp.down_proj"]


def test_measure_then_refine(smollm2, tmp_path, capsys):
    table = tmp_path / "t.json"
    common = ["--model", smollm2, "--corpus", "licenses", "--n-seq", "1", "--seq-len", "32"]
    assert main(["measure", *common, "--tensors", *TENSORS, "--candidates", "2b_g64", "4b_g64",
                 "--out", str(table)]) == 0
    t = json.loads(table.read_text())
    assert t["complete"] and [e["path"] for e in t["entries"]] == TENSORS
    for e in t["entries"]:
        kl = {c["kind"]: c["kl"] for c in e["candidates"]}
        assert kl["2b_g64"] > kl["4b_g64"] > 0
    # resuming a complete table does no work and keeps it
    assert main(["measure", *common, "--tensors", *TENSORS, "--candidates", "2b_g64", "4b_g64",
                 "--out", str(table), "--resume"]) == 0
    assert json.loads(table.read_text())["entries"] == t["entries"]
    alloc = tmp_path / "a.json"
    assert main(["refine", str(table), *common, "--bpw", "3.5", "--max-evals", "2",
                 "--out", str(alloc)]) == 0
    a = json.loads(alloc.read_text())
    assert a["average_bpw_storage"] <= 3.5 and len(a["assignment"]) == 2
    assert "joint KL" in capsys.readouterr().out
