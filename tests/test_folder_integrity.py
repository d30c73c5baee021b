"""Saved model folders: written aside and renamed with a completeness
marker; safetensors headers validated on load (the safetensors package is
the reference for what a valid header is)."""

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")

import mixbits  # noqa: E402
from mixbits.errors import FormatError, IncompleteFolderError, OutputPathError  # noqa: E402
from mixbits.folder import MANIFEST  # noqa: E402
from mixbits.formats.safetensors_header import read_header  # noqa: E402
from tiny_model import tiny_llama  # noqa: E402

TESTS = Path(__file__).resolve().parent


def _saved(tmp_path, name="m"):
    model = tiny_llama(layers=1)
    mixbits.quantize_model(model, {"model.layers.0.mlp.down_proj": [(4, 64, 64), (3, 32, 64)]})
    return mixbits.save(model, tmp_path / name)


def _write_st(path, entries, data: bytes, folder=None):
    """A safetensors file with the header given as (name, dict) pairs, so
    names may repeat; the marker's recorded size is updated to match."""
    body = "{" + ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in entries) + "}"
    raw = body.encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    if folder is not None:
        m = json.loads((folder / MANIFEST).read_text())
        m["files"][path.name] = path.stat().st_size
        (folder / MANIFEST).write_text(json.dumps(m))


def _entries_and_data(path):
    header = read_header(path)
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    data = path.read_bytes()[8 + n:]
    return list(header.items()), data


def _safetensors_refuses(path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            for k in f.keys():
                f.get_tensor(k)
    except Exception:
        return True
    return False


def test_valid_files_pass_and_match_the_safetensors_package(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    a = tmp_path / "a.safetensors"
    mx.save_safetensors(str(a), {"x": mx.zeros((3, 5), mx.float16), "y": mx.arange(7), "z": mx.zeros((0, 4))})
    b = tmp_path / "b.safetensors"
    save_file({"p": np.ones((2, 3), np.float32), "q": np.zeros(9, np.uint8)}, str(b), metadata={"k": "v"})
    for f in (a, b):
        h = read_header(f)
        with safe_open(str(f), framework="numpy") as ref:
            assert sorted(h) == sorted(ref.keys())
            for k in ref.keys():
                assert list(ref.get_slice(k).get_shape()) == h[k]["shape"]


def test_duplicate_tensor_name_is_refused(tmp_path):
    folder = _saved(tmp_path)
    st = folder / "model.safetensors"
    entries, data = _entries_and_data(st)
    name, first = entries[0]
    # a second entry under the first one's name, pointing at another tensor's bytes
    entries[1] = (name, entries[1][1])
    _write_st(st, entries, data, folder)
    assert _safetensors_refuses(st)
    with pytest.raises(FormatError, match="appears twice"):
        mixbits.load(folder)


def test_overlapping_offsets_are_refused(tmp_path):
    folder = _saved(tmp_path)
    st = folder / "model.safetensors"
    entries, data = _entries_and_data(st)
    # two tensors of one size: make the second read the first one's bytes
    sized = {}
    for i, (k, v) in enumerate(entries):
        sized.setdefault((v["dtype"], tuple(v["shape"])), []).append(i)
    i, j = next(ix for ix in sized.values() if len(ix) >= 2)[:2]
    entries[j][1]["data_offsets"] = list(entries[i][1]["data_offsets"])
    _write_st(st, entries, data, folder)
    assert _safetensors_refuses(st)
    with pytest.raises(FormatError, match="overlaps|gap"):
        mixbits.load(folder)


@pytest.mark.parametrize("corrupt,match", [
    (lambda b: b[:5], "too short"),
    (lambda b: struct.pack("<Q", len(b)) + b[8:], "does not fit"),
    (lambda b: b[:8] + b"\xff\xfe" + b[10:], "not UTF-8"),
    (lambda b: b[:8] + b"[" + b[9:], "not valid JSON|must be a JSON object"),
    (lambda b: b[:-4], "cover"),
])
def test_broken_headers_are_format_errors(tmp_path, corrupt, match):
    folder = _saved(tmp_path)
    st = folder / "model.safetensors"
    st.write_bytes(corrupt(st.read_bytes()))
    assert _safetensors_refuses(st)
    with pytest.raises(FormatError, match=match):
        read_header(st)
    with pytest.raises((FormatError, IncompleteFolderError)):
        mixbits.load(folder)


def test_broken_config_json_is_a_format_error(tmp_path):
    folder = _saved(tmp_path)
    (folder / "config.json").write_text("[1, 2")
    with pytest.raises(FormatError, match="config.json"):
        mixbits.load(folder)
    (folder / "config.json").write_text("[]")
    with pytest.raises(FormatError, match="expected an object"):
        mixbits.load(folder)
    (folder / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(FormatError, match="not UTF-8"):
        mixbits.load(folder)


def test_saved_folder_has_marker_and_loads(tmp_path):
    folder = _saved(tmp_path)
    m = json.loads((folder / MANIFEST).read_text())
    # a two-segment layer: mlx-lm needs mixbits' model file (mixbits.mlx_lm_model_file)
    assert set(m["files"]) == {"model.safetensors", "config.json", "mixbits_model.py"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left
    model, _, _ = mixbits.load(folder)
    mixbits.save(model, folder)  # replacing a folder mixbits wrote is allowed
    mixbits.load(folder)


def test_missing_or_truncated_files_are_detected(tmp_path):
    folder = _saved(tmp_path)
    (folder / "tokenizer.json").write_text("{}")
    m = json.loads((folder / MANIFEST).read_text())
    m["files"]["tokenizer.json"] = 2
    (folder / MANIFEST).write_text(json.dumps(m))
    (folder / "tokenizer.json").unlink()
    with pytest.raises(IncompleteFolderError, match="missing.*tokenizer.json"):
        mixbits.load(folder)
    del m["files"]["tokenizer.json"]
    (folder / MANIFEST).write_text(json.dumps(m))
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-100])
    with pytest.raises(IncompleteFolderError, match="changed size"):
        mixbits.load(folder)
    (folder / MANIFEST).unlink()  # config.json says mixbits wrote it: the marker is required
    with pytest.raises(IncompleteFolderError, match="interrupted"):
        mixbits.load(folder)


def test_foreign_folder_is_not_overwritten(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(OutputPathError, match="did not write"):
        _saved(tmp_path, "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


KILL_DURING_SAVE = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[2])
import mixbits
from tiny_model import tiny_llama

class KilledTokenizer:
    def save(self, folder):  # config.json and the weights are written by now
        assert (folder / "config.json").exists()
        os.kill(os.getpid(), signal.SIGKILL)

model = tiny_llama(layers=1, seed=int(sys.argv[3]))
mixbits.quantize_model(model, {"model.layers.0.mlp.down_proj": 4})
mixbits.save(model, sys.argv[1], tokenizer=KilledTokenizer())
"""


def test_save_killed_mid_way_leaves_no_loadable_half_folder(tmp_path):
    out = tmp_path / "out"
    run = [sys.executable, "-c", KILL_DURING_SAVE, str(out), str(TESTS)]
    p = subprocess.run(run + ["0"], capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert not out.exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert leftovers and (leftovers[0] / "config.json").exists()
    with pytest.raises(IncompleteFolderError, match="interrupted"):
        mixbits.load(leftovers[0])
    # a kill while replacing a finished folder leaves the old one whole
    model = tiny_llama(layers=1, seed=5)
    mixbits.quantize_model(model, {"model.layers.0.mlp.down_proj": 4})
    mixbits.save(model, out)
    before = (out / "model.safetensors").read_bytes()
    p = subprocess.run(run + ["1"], capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert (out / "model.safetensors").read_bytes() == before
    mixbits.load(out)


@pytest.mark.parametrize("section", [5, [], {"layers": 3}, {"layers": None}])
def test_malformed_mixbits_section_is_one_format_error(tmp_path, section):
    """config.json's "mixbits" block is read the same way by mixbits.load
    and by the folder's mlx-lm model file (stock mlx-lm's way in)."""
    from mixbits.mlx_lm_model_file import build_model

    folder = _saved(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["mixbits"] = section
    (folder / "config.json").write_text(json.dumps(config))
    manifest = json.loads((folder / MANIFEST).read_text())  # an edit, not a truncation
    manifest["files"]["config.json"] = (folder / "config.json").stat().st_size
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="'mixbits' must be an object with a 'layers' object"):
        mixbits.load(folder)
    with pytest.raises(FormatError, match="'mixbits' must be an object with a 'layers' object"):
        build_model(config)
    del config["mixbits"]  # the model file exists only for folders that have the block
    with pytest.raises(FormatError, match="'mixbits' must be an object"):
        build_model(config)
