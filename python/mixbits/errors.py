"""The package's one error hierarchy.

Every error mixbits raises on purpose is a :class:`MixbitsError`. Each
subclass also derives from the built-in type MLX (and Python) would use for
the same mistake, so code that catches ``ValueError`` around an MLX call
catches ours too: bad values and bad files are ``ValueError``, output
paths that cannot be written are ``OSError``. The ``mixbits`` command
prints any of them as one line (``mixbits.cli.main``).
"""

from __future__ import annotations


class MixbitsError(Exception):
    """Base of every error mixbits raises deliberately."""


class FormatError(MixbitsError, ValueError):
    """A file or object does not follow the format it claims to be."""


class IncompleteFolderError(FormatError):
    """A model folder is missing files its completeness marker lists, or was
    never finished (a save interrupted before the final rename)."""


class OutputPathError(MixbitsError, OSError):
    """An output path cannot be written safely (a directory, a device, an
    unwritable folder ...)."""


class OutputBusyError(OutputPathError):
    """Another process is writing the same output right now (it holds the
    output's lock, :func:`mixbits.lock.output_lock`)."""


class UsageError(MixbitsError, ValueError):
    """A command-line argument or function argument has a bad value."""


class CalibrationWarning(UserWarning):
    """A result rests on a calibration set too small or noisy for it (e.g.
    an allocation that lost to uniform quantization and was replaced)."""


class MemoryWarning(UserWarning):
    """The work is projected to need more memory than the machine has
    available: it may be killed part way (said before it starts)."""


class TimeBudgetWarning(UserWarning):
    """No way of doing the work is projected to fit the time the user gave;
    the cheapest runs anyway."""
