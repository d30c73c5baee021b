"""Kill a real `mixbits convert` process part way and check what a rerun of
the same command makes of it: the pattern the resume tests of every
measure method share (test_convert_cli: exact sweep; test_grad_resume:
the gradient stage)."""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path


def kill_when(proc: subprocess.Popen, ready, timeout: float, what: str) -> None:
    """SIGKILL ``proc`` as soon as ``ready()`` holds; fail if it ended first
    (the test would then check nothing about a resume)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(0.002)
    assert proc.poll() is None, f"{what} finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def rerun_and_clean(base: list[str], killed: Path, clean: Path, env: dict) -> None:
    """Run the killed command again (it must say it continues) and the same
    command into a fresh ``clean`` folder, both to success."""
    r = subprocess.run(base + ["--out", str(killed)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "continuing the last run" in r.stdout
    r = subprocess.run(base + ["--out", str(clean)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def table_kls(path: Path) -> dict:
    """{tensor path: {candidate kind: KL}} of a measurement table."""
    t = json.loads(Path(path).read_text())
    return {e["path"]: {c["kind"]: c["kl"] for c in e["candidates"]} for e in t["entries"]}
