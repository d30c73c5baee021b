"""Inputs that gave a traceback, a vague message or a silently wrong value
(issue 42's leftovers) now give one clear error naming the file, before
any model loads where no model is needed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

import mixbits  # noqa: E402
import mixbits.models  # noqa: E402
from mixbits.cli import main  # noqa: E402
from mixbits.errors import FormatError  # noqa: E402
from mixbits.folder import MANIFEST  # noqa: E402
from mixbits.formats.allocation import Allocation  # noqa: E402
from tiny_model import tiny_llama  # noqa: E402

TESTS = Path(__file__).resolve().parent
Q = {"q_proj": {"group_size": {"4": 64}, "bits": [4], "bits_prop": [1.0], "scale_bits": 4}}


def _option(acc, total_bits):
    return {"accuracy": acc, "total_bits": total_bits, **Q}


def test_total_bits_past_int64_is_one_line(tmp_path, capsys):
    m = tmp_path / "m.json"
    m.write_text(json.dumps({"measurement": {"model.layers.0.self_attn": [
        _option(0.9, 10**30), _option(0.95, 1000)]}, "last_module_idx": 0}))
    assert main(["allocate", str(m), "--budget-bits", "5000", "--out", str(tmp_path / "a.json")]) == 2
    err = capsys.readouterr().err
    assert "model.layers.0.self_attn" in err and "more than 2**62" in err  # was an OverflowError


def test_duplicate_module_key_in_a_measurement_is_refused(tmp_path, capsys):
    one = json.dumps([_option(0.9, 500), _option(0.95, 1000)])
    other = json.dumps([_option(0.5, 500), _option(0.6, 1000)])
    m = tmp_path / "m.json"
    m.write_text('{"measurement": {"model.layers.0.self_attn": %s, "model.layers.0.self_attn": %s}, '
                 '"last_module_idx": 0}' % (one, other))
    assert main(["allocate", str(m), "--budget-bits", "5000", "--out", str(tmp_path / "a.json")]) == 2
    err = capsys.readouterr().err
    assert "'model.layers.0.self_attn' appears twice" in err and str(m) in err  # was last-wins


def _alloc(**over):
    e = {"path": "model.layers.0.mlp.up_proj", "layer": 0, "nparams": 4096, "bits": 4, "kind": "4",
         "kl": 0.1}
    e.update(over.pop("entry", {}))
    return {"average_bits": 4.0, "assignment": [e], **over}


@pytest.mark.parametrize("raw, needle", [
    (_alloc(entry={"kl": -1}), "kl'\\]: must be >= -1e-06, got -1"),
    (_alloc(embed_bits=99), "embed_bits'\\]: 99 is not a width"),
])
def test_allocation_values_out_of_range_are_refused(raw, needle):
    with pytest.raises(FormatError, match=needle):
        Allocation.from_dict(raw)
    Allocation.from_dict(_alloc(embed_bits=16))  # half precision embeddings: fine


def test_unknown_kind_in_an_allocation_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(mixbits, "load", no_load)
    for kind, needle in (("5b_g48", "group size must be one of"), ("4b_g64+magic", "unknown quantizer")):
        a = tmp_path / "a.json"
        a.write_text(json.dumps(_alloc(entry={"kind": kind, "bits": int(kind[0])},
                                       average_bits=int(kind[0]))))
        assert main(["quantize", "--model", "smollm2", "--allocation", str(a),
                     "--out", str(tmp_path / "q")]) == 2
        err = capsys.readouterr().err
        assert needle in err and "model.layers.0.mlp.up_proj" in err


def test_garbage_tokenizer_json_is_named(tmp_path):
    from mixbits.models.tokenizer import Tokenizer

    (tmp_path / "tokenizer.json").write_bytes(b"\xff\xfe garbage \x00\x81")
    with pytest.raises(FormatError, match=f"{tmp_path / 'tokenizer.json'}: not a tokenizer"):
        Tokenizer.from_folder(tmp_path)
    from tokenizers import Tokenizer as Tk
    from tokenizers.models import WordLevel

    Tk(WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(FormatError, match="tokenizer_config.json"):
        Tokenizer.from_folder(tmp_path)


def test_fractional_segment_bits_in_config_are_refused(tmp_path):
    model = tiny_llama(layers=1)
    mixbits.quantize_model(model, {"model.layers.0.mlp.down_proj": [(4, 64, 64), (3, 32, 64)]})
    out = tmp_path / "m"
    mixbits.save(model, out)
    cfg = json.loads((out / "config.json").read_text())
    segs = cfg["mixbits"]["layers"]["model.layers.0.mlp.down_proj"]["segments"]
    assert segs[1][0] == 3
    segs[1][0] = 3.9
    (out / "config.json").write_text(json.dumps(cfg))
    man = json.loads((out / MANIFEST).read_text())  # as if the folder had been re-marked
    man["files"]["config.json"] = (out / "config.json").stat().st_size
    (out / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(FormatError, match="model.layers.0.mlp.down_proj.*'segments'.*3.9"):
        mixbits.load(out)  # was read as 3 bits


FULL_DISK = r"""
import resource, signal, sys
sys.path.insert(0, sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the limit: writes fail (EFBIG), as on a full disk
import mixbits
from tiny_model import tiny_llama

model = tiny_llama(layers=1)
resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))
try:
    mixbits.save(model, sys.argv[1])
except Exception as e:
    print(type(e).__name__, e)
"""


def test_failed_weight_write_names_the_folder(tmp_path):
    out = tmp_path / "q"
    r = subprocess.run([sys.executable, "-c", FULL_DISK, str(out), str(TESTS)], capture_output=True,
                       text=True, timeout=300)
    assert r.stdout.startswith("OutputPathError"), r.stdout + r.stderr
    assert f"cannot write the model folder {out}" in r.stdout and "free on" in r.stdout
    assert not out.exists() and not list(tmp_path.glob(".q.tmp-*"))


def test_compare_save_allocations_checked_before_the_model_loads(tmp_path, capsys):
    from test_cli_errors import NO_MODEL, _table_file

    f = tmp_path / "file"
    f.write_text("not a folder")
    for d in (f, f / "sub"):  # used to fail only when the first allocation was written
        assert main(["compare", str(_table_file(tmp_path)), "--model", NO_MODEL,
                     "--save-allocations", str(d)]) == 2
        err = capsys.readouterr().err
        assert f"--save-allocations {d}" in err, err


@pytest.mark.parametrize("command", ["refine", "compare"])
def test_unknown_kind_in_a_table_is_refused_before_the_model_loads(tmp_path, capsys, command):
    from test_cli_errors import NO_MODEL, tiny_table

    t = tiny_table()
    t["entries"][1]["candidates"][0]["kind"] = "3b_g48"
    path = tmp_path / "t.json"
    path.write_text(json.dumps(t))
    extra = ["--bpw", "3.5", "--out", str(tmp_path / "a.json")] if command == "refine" else []
    assert main([command, str(path), "--model", NO_MODEL, *extra]) == 2
    err = capsys.readouterr().err
    assert "entries[1]['candidates'][0] (model.layers.1.mlp.up_proj)" in err and "group size" in err, err


def test_config_head_counts_that_lie_name_config_json(tmp_path):
    import tiny_models

    model, cfg = tiny_models.build("llama")
    out = tmp_path / "m"
    mixbits.save(model, out, cfg)
    c = json.loads((out / "config.json").read_text())
    c["num_attention_heads"] = 8  # 4 in the weights (head_dim 16)
    (out / "config.json").write_text(json.dumps(c))
    man = json.loads((out / MANIFEST).read_text())
    man["files"]["config.json"] = (out / "config.json").stat().st_size
    (out / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(FormatError, match=r"config.json does not describe these weights: "
                                          r"model.layers.\d+.self_attn has 8 heads .* 64 output rows"):
        mixbits.load(out)  # loaded, then failed in MLX's rope: '[rope] dims must not exceed ...'
