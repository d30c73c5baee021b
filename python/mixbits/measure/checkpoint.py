"""Crash-safe JSON files: a reader never sees a half-written file, and a
job killed at any moment leaves either the old or the new version."""

from __future__ import annotations

import json
from pathlib import Path

from ..atomic import write_json_atomic


def atomic_write_json(path, obj, indent: int | None = 1) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (see mixbits.atomic)."""
    write_json_atomic(obj, path, indent)


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
