"""A saved folder is exactly its manifest, and saves clean up after the
ones that were killed:

- a stray ``model_old.safetensors`` beside a saved folder's weights (not
  in its manifest) was globbed and merged over the saved weights;
- a killed save's hidden ``.NAME.tmp-*`` folder was never removed; now the
  next save to the same place removes it (sparing a live save's), and two
  saves into one folder at once are refused.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import warnings

import pytest

pytest.importorskip("mlx_lm")

import mixbits  # noqa: E402
from mixbits.errors import FormatError, OutputBusyError  # noqa: E402
from test_folder_integrity import KILL_DURING_SAVE, TESTS  # noqa: E402
from tiny_model import tiny_llama  # noqa: E402


def _model(seed=0):
    model = tiny_llama(layers=1, seed=seed)
    mixbits.quantize_model(model, {"model.layers.0.mlp.down_proj": 4})
    return model


def test_unlisted_weight_file_is_refused_not_merged(tmp_path):
    mixbits.save(_model(0), tmp_path / "a")
    mixbits.save(_model(1), tmp_path / "b")
    shutil.copy(tmp_path / "b" / "model.safetensors", tmp_path / "a" / "model_old.safetensors")
    with pytest.raises(FormatError, match=r"\['model_old.safetensors'\] are not listed in its "
                                           "mixbits_manifest.json"):
        mixbits.load(tmp_path / "a")
    (tmp_path / "a" / "model_old.safetensors").unlink()
    mixbits.load(tmp_path / "a")


def test_next_save_removes_a_killed_saves_temp_folder(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, str(out), str(TESTS), "0"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr
    left = [q.name for q in tmp_path.iterdir() if q.name.startswith(".out.tmp-")]
    assert left
    with pytest.warns(UserWarning, match=f"removed 1 temp folder.*{left[0]}"):
        mixbits.save(_model(), out)
    assert sorted(q.name for q in tmp_path.iterdir()) == ["out"]
    mixbits.load(out)


def test_a_live_saves_temp_folder_is_kept(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        mine = tmp_path / f".out.tmp-{live.pid}-abcd"
        mine.mkdir()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing removed, nothing said
            mixbits.save(_model(), tmp_path / "out")
        assert mine.is_dir()
    finally:
        live.kill()
        live.wait()
    with pytest.warns(UserWarning, match="removed 1"):  # its process gone: removed
        mixbits.save(_model(), tmp_path / "out")
    assert not mine.exists()


def test_two_saves_into_one_folder_are_refused(tmp_path):
    hold = ("import sys, time; from mixbits.lock import output_lock\n"
            "with output_lock(sys.argv[1]):\n    print('locked', flush=True); time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / "out")], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(OutputBusyError, match=f"pid {p.pid}"):
            mixbits.save(_model(), tmp_path / "out")
    finally:
        p.kill()
        p.wait()
    assert not (tmp_path / "out").exists()


def test_second_quantize_into_one_folder_is_refused_before_the_model_loads(tmp_path, capsys,
                                                                          monkeypatch):
    from mixbits.cli import main
    from shared_files import ALLOC

    hold = ("import sys, time; from mixbits.lock import output_lock\n"
            "with output_lock(sys.argv[1]):\n    print('locked', flush=True); time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / "q")], stdout=subprocess.PIPE,
                         text=True)
    monkeypatch.setattr(mixbits, "load", lambda *a, **k: pytest.fail("model loaded"))
    try:
        assert p.stdout.readline().strip() == "locked"
        assert main(["quantize", "--model", "smollm2", "--allocation", str(ALLOC),
                     "--out", str(tmp_path / "q")]) == 2
        assert f"pid {p.pid}" in capsys.readouterr().err
    finally:
        p.kill()
        p.wait()
