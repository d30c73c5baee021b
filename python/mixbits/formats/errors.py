"""Errors and checked accessors for the file formats.

Every reader in :mod:`mixbits.formats` walks untrusted JSON through the
helpers here, so a malformed file fails with a :class:`FormatError` that
names the exact key path (``measurement['model.layers.3.mlp'][2]['accuracy']``)
instead of a bare ``KeyError``/``TypeError`` from deep inside the parser.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from ..atomic import write_json_atomic  # noqa: F401  (re-exported for the format modules)
from ..errors import FormatError  # noqa: F401  (the format modules import it from here)


def at(where: str, key) -> str:
    """The path of ``key`` inside the object at ``where``."""
    return f"{where}[{key!r}]"


def _kind(obj) -> str:
    if obj is None:
        return "null"
    if isinstance(obj, bool):
        return "a boolean"
    if isinstance(obj, str):
        return repr(obj) if len(obj) <= 40 else repr(obj[:37] + "...")
    if isinstance(obj, dict):
        return "an object"
    if isinstance(obj, list):
        return "a list"
    return repr(obj)


def expect_dict(obj, where: str) -> dict:
    if not isinstance(obj, dict):
        raise FormatError(f"{where}: expected an object, got {_kind(obj)}")
    return obj


def expect_list(obj, where: str) -> list:
    if not isinstance(obj, list):
        raise FormatError(f"{where}: expected a list, got {_kind(obj)}")
    return obj


def expect_str(obj, where: str) -> str:
    if not isinstance(obj, str):
        raise FormatError(f"{where}: expected a string, got {_kind(obj)}")
    return obj


def expect_number(obj, where: str, *, lo=None, hi=None, lo_open=False) -> float:
    """A finite JSON number (bool is rejected: ``true`` is not 1 here)."""
    if isinstance(obj, bool) or not isinstance(obj, (int, float)):
        raise FormatError(f"{where}: expected a number, got {_kind(obj)}")
    if not math.isfinite(obj):
        raise FormatError(f"{where}: expected a finite number, got {obj!r}")
    if lo is not None and (obj <= lo if lo_open else obj < lo):
        raise FormatError(f"{where}: must be {'>' if lo_open else '>='} {lo}, got {obj!r}")
    if hi is not None and obj > hi:
        raise FormatError(f"{where}: must be <= {hi}, got {obj!r}")
    return obj


def expect_int(obj, where: str, *, lo=None) -> int:
    """A JSON integer; ``12.0`` is accepted (some writers emit it) as 12."""
    if isinstance(obj, float) and obj.is_integer():
        obj = int(obj)
    if isinstance(obj, bool) or not isinstance(obj, int):
        raise FormatError(f"{where}: expected an integer, got {_kind(obj)}")
    if lo is not None and obj < lo:
        raise FormatError(f"{where}: must be >= {lo}, got {obj!r}")
    return obj


def require(d: dict, key: str, where: str):
    if key not in d:
        raise FormatError(f"{where}: missing key {key!r}")
    return d[key]


def check_close(stored: float, recomputed: float, where: str, what: str, rel: float = 1e-9):
    """Stored summary values must match what the body implies."""
    if not math.isclose(stored, recomputed, rel_tol=rel, abs_tol=rel):
        raise FormatError(f"{where}: stored {what} {stored!r} != {recomputed!r} recomputed from the entries")


def load_json(source, name: str, *, unique_keys: bool = False):
    """Parse ``source`` (a path, or an already-parsed object) as JSON.

    Truncated or invalid JSON becomes a FormatError naming the file, line and
    column, so the user sees which file is broken and where. ``unique_keys``:
    an object with a key twice is refused (see :func:`parse_json`)."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FormatError(f"{name}: file not found: {path}") from None
        except IsADirectoryError:
            raise FormatError(f"{name}: {path} is a directory, not a JSON file") from None
        except UnicodeDecodeError as e:
            raise FormatError(f"{name}: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise FormatError(f"{name}: cannot read {path}: {e.strerror or e}") from None
        return parse_json(text, f"{name}: {path}", unique_keys=unique_keys)
    return source


def parse_json(text: str, where: str, *, unique_keys: bool = False):
    """``json.loads`` whose failures are FormatErrors naming ``where``.

    Nesting deep enough to exhaust Python's recursion limit is refused as
    malformed instead of escaping as a RecursionError. ``unique_keys``: an
    object with a key twice (JSON readers silently keep the last one; two
    measurements of one module, say) is refused, naming the key."""

    def unique(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise FormatError(f"{where}: key {k!r} appears twice in one object; which one is "
                                  "meant is unclear (remove one)")
            seen.add(k)
        return dict(pairs)

    try:
        return json.loads(text, object_pairs_hook=unique if unique_keys else None)
    except json.JSONDecodeError as e:
        raise FormatError(f"{where} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except RecursionError:
        raise FormatError(f"{where}: JSON nested too deeply to be a real file") from None
