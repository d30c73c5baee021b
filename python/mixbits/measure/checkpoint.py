"""Reading the sweep's JSON files (checkpoints, tables, allocations) with
errors that name the file; writing goes through mixbits.atomic."""

from __future__ import annotations

import json
from pathlib import Path


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
