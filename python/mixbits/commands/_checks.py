"""Argument and input checks shared by the commands, run before anything
slow (a model load takes 10-40 s): a bad value fails at once, as one line
(the errors are MixbitsErrors; mixbits.cli prints them)."""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import FormatError, UsageError  # noqa: F401  (UsageError: for the commands)


def at_least(name: str, value, lo) -> None:
    if value is not None and value < lo:
        raise UsageError(f"{name} must be >= {lo}, got {value}")


def positive_bpw(name: str, value) -> None:
    values = value if isinstance(value, list) else [value]
    for v in values:
        if v is not None and not (math.isfinite(v) and v > 0):
            raise UsageError(f"{name} must be a positive number of bits per weight, got {v}")


def calibration(args) -> None:
    """--text / --tokens / --n-seq / --seq-len of add_calibration_arguments."""
    from ..measure.calib import check_calibration_arguments

    check_calibration_arguments(args)


def read_table(path, *, require_complete: bool = True, known_kinds: bool = True) -> dict:
    """A sensitivity table (as the dict the measure code takes), validated
    by the format reader first, so a bad file is a FormatError naming the
    key, never a KeyError from deep inside. ``known_kinds``: every
    candidate kind must be one mixbits can build (checked now: the commands
    that build them do so only after the model load)."""
    from ..formats import SensitivityTable, is_sensitivity_table
    from ..formats.errors import load_json

    raw = load_json(path, str(path), unique_keys=True)
    if not is_sensitivity_table(raw):
        if isinstance(raw, dict) and "measurement" in raw:
            raise FormatError(
                f"{path} is an ExLlamaV2 measurement, not a sensitivity table: this command needs the "
                "table `mixbits measure` writes (`mixbits allocate` reads measurements)"
            )
        raise FormatError(f"{path}: not a sensitivity table ('format': 'mixbits.sensitivity' missing)")
    table = SensitivityTable.from_dict(raw)
    if require_complete and not table.complete:
        raise FormatError(f"{path}: the sweep that wrote this table has not finished ('complete': false)")
    if known_kinds:
        from ..measure.candidates import parse_candidate

        for i, e in enumerate(table.entries):
            for j, c in enumerate(e.candidates):
                try:
                    parse_candidate(c.kind)
                except ValueError as err:
                    raise FormatError(f"{path}: entries[{i}]['candidates'][{j}] ({e.path}): {err}") from None
    return raw
