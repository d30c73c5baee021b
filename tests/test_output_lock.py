"""One writer per output: a second `mixbits measure` on the same --out is
refused at once, naming the first one's pid, and a SIGKILLed holder leaves
no lock behind. Real processes throughout (the lock is per process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mixbits.errors import OutputBusyError
from mixbits.lock import lock_path, output_lock

pytest.importorskip("mlx_lm")

HOLD = ("import sys, time; from mixbits.lock import output_lock\n"
        "with output_lock(sys.argv[1]):\n"
        "    print('locked', flush=True); time.sleep(120)\n")


def _holder(path):
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_second_process_is_refused_with_the_holders_pid(tmp_path):
    out = tmp_path / "t.json"
    p = _holder(out)
    try:
        with pytest.raises(OutputBusyError, match=f"pid {p.pid}"):
            with output_lock(out):
                pass
        # another name of the same file shares the lock
        (tmp_path / "link.json").symlink_to(out)
        with pytest.raises(OutputBusyError):
            with output_lock(tmp_path / "link.json"):
                pass
    finally:
        p.kill()
        p.wait()


def test_sigkill_leaves_no_stale_lock(tmp_path):
    out = tmp_path / "t.json"
    p = _holder(out)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert lock_path(out).exists()  # the file stays; its lock died with the process
    with output_lock(out):
        assert lock_path(out).read_text().strip() == str(os.getpid())
    assert not lock_path(out).exists()  # a clean release removes it


def test_reentrant_within_a_process(tmp_path):
    out = tmp_path / "t.json"
    with output_lock(out):
        with output_lock(out):
            pass
        assert lock_path(out).exists()  # still held by the outer block
        r = subprocess.run([sys.executable, "-c", HOLD, str(out)], capture_output=True, text=True)
        assert r.returncode != 0 and f"pid {os.getpid()}" in r.stderr


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import mixbits
    import tiny_models

    d = tmp_path_factory.mktemp("lock")
    model, cfg = tiny_models.build("llama")
    mixbits.save(model, d / "model", cfg)
    np.save(d / "tokens.npy", np.random.default_rng(3).integers(0, 160, (2, 16)))
    return d


def _measure(folder, out, *extra):
    cmd = [sys.executable, "-m", "mixbits", "measure", "--model", str(folder / "model"),
           "--tokens", str(folder / "tokens.npy"), "--candidates", "2b_g32", "4b_g64",
           "--out", str(out), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_measure_runs_on_one_out(folder, tmp_path):
    """The issue's case: two runs with one --out and different tensors both
    said "wrote" and the file held one run's tensors. Now the second is
    refused while the first (held stopped, lock taken) keeps its output."""
    out = tmp_path / "t.json"
    a = _measure(folder, out, "--tensors", "model.layers.0.mlp.down_proj")
    try:
        deadline = time.monotonic() + 120
        while a.poll() is None and time.monotonic() < deadline:
            lock = lock_path(out)
            if lock.exists() and lock.read_text().strip() == str(a.pid):
                break
            time.sleep(0.01)
        a.send_signal(signal.SIGSTOP)  # a stopped process keeps its lock
        t0 = time.monotonic()
        b = _measure(folder, out, "--tensors", "model.layers.1.mlp.down_proj")
        _, err = b.communicate(timeout=300)
        assert b.returncode == 2, err
        assert f"pid {a.pid}" in err and "being written by another process" in err
        assert time.monotonic() - t0 < 60
    finally:
        a.send_signal(signal.SIGCONT)
    assert a.wait(timeout=300) == 0
    t = json.loads(out.read_text())
    assert t["complete"] and [e["path"] for e in t["entries"]] == ["model.layers.0.mlp.down_proj"]
    assert not lock_path(out).exists()
    # after the first run, the same --out is free again (and resumable)
    c = _measure(folder, out, "--tensors", "model.layers.0.mlp.down_proj", "--resume")
    assert c.wait(timeout=300) == 0, c.stderr.read()


def test_missing_folders_are_made_as_the_writers_make_them(tmp_path):
    from mixbits.errors import OutputPathError

    with output_lock(tmp_path / "new" / "sub" / "t.json") as lock:
        assert lock.exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputPathError, match="a parent of it is not a folder"):
        with output_lock(tmp_path / "file" / "t.json"):
            pass
