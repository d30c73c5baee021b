"""A sweep killed with SIGKILL at a random moment and resumed ends with
exactly the results of an uninterrupted run."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

HERE = Path(__file__).resolve().parent


def run_worker(out, mode):
    env = dict(os.environ, PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, str(HERE / "sweep_worker.py"), str(out), mode], env=env)


def entries(path):
    t = json.loads(Path(path).read_text())
    return t["complete"], [{k: v for k, v in e.items() if k != "seconds"} for e in t["entries"]]


def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
    full = tmp_path / "full.json"
    assert run_worker(full, "fresh").wait(timeout=300) == 0
    done, want = entries(full)
    assert done and len(want) == 29  # the tied embedding + 4 layers x 7 linears

    part = tmp_path / "part.json"
    rng = random.Random(os.getpid())
    kills = 0
    for attempt in range(3):
        p = run_worker(part, "resume" if part.exists() else "fresh")
        # wait for the first checkpoint of this attempt, then a random delay
        start = time.monotonic()
        before = part.stat().st_mtime_ns if part.exists() else 0
        while p.poll() is None and time.monotonic() - start < 120:
            if part.exists() and part.stat().st_mtime_ns != before:
                break
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()
            kills += 1
            # whatever is on disk must be a whole, readable table
            complete, got = entries(part)
            assert got == want[: len(got)]
        else:
            assert p.returncode == 0
            break
    assert kills >= 1, "the worker finished before it could be killed"
    p = run_worker(part, "resume")
    assert p.wait(timeout=300) == 0
    assert entries(part) == (True, want)
