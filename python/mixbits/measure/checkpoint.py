"""Crash-safe JSON files: a reader never sees a half-written file, and a
job killed at any moment leaves either the old or the new version."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def atomic_write_json(path, obj, indent: int | None = 1) -> None:
    """Write ``obj`` as JSON to ``path`` atomically: temp file in the same
    folder, flush + fsync, ``os.replace``, then fsync the folder so the
    rename itself survives a power cut."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=indent, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_json(path, what: str = "file"):
    """Load JSON with an error that names the file when it is corrupt."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON (truncated or corrupt?): {e}") from None
