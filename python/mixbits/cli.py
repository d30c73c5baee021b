"""The ``mixbits`` command. Each subcommand lives in mixbits.commands.<name>
as ``add_arguments(parser)`` and ``run(args) -> int``; modules are imported
only when their subcommand runs, so ``mixbits --help`` stays fast."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .errors import MixbitsError

# name -> one-line help. A name listed here must have its module.
COMMANDS = {
    "demo": "quantize a random matrix into mixed segments; error and bits per weight",
    "convert": "model -> quantized folder at a storage-bpw budget in one command (measure, refine, quantize)",
    "allocate": "exact bit allocation from an ExLlamaV2 measurement or a sensitivity table",
    "measure": "per-tensor sensitivity sweep (KL of final logits per candidate), resumable",
    "refine": "sensitivity table -> allocation.json: exact optimum, then joint-KL swaps",
    "compare": "joint KL of allocation strategies (ours, DP, uniform, mixed rule) at matched bpw",
    "plot": "heatmap of a sensitivity table (layers x tensor kinds, per candidate)",
    "generate": "greedy text generation with a real model (stock MLX or --patch mixbits layers)",
    "quantize": "apply an allocation.json to a model and save it as a folder",
    "bench": "quantized-matmul benchmark vs MLX and numpy, with a memory-bandwidth probe",
}


# Long commands end with their peak resident set ("peak memory 3.10 GiB").
REPORTS_PEAK = ("convert", "measure", "quantize", "refine", "compare")


def _message(e: BaseException) -> str:
    """One line for ``e``. OSErrors raised by the OS carry errno text and
    the file name; ours carry a full sentence already."""
    if isinstance(e, OSError) and not isinstance(e, MixbitsError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    return str(e)


def _warnings_as_lines(command: str) -> None:
    """Our own warnings (e.g. CalibrationWarning) print as one line like
    the errors; other libraries' keep Python's format."""
    import warnings

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if category.__module__.startswith("mixbits."):
            print(f"mixbits {command}: warning: {message}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def _module(name: str):
    return importlib.import_module(f"mixbits.commands.{name}")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="mixbits", description="Mixed-precision quantization for MLX.")
    p.add_argument("--version", action="version", version=f"mixbits {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(_name=name)
        if argv and argv[0] == name:
            _module(name).add_arguments(sp)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    _warnings_as_lines(args._name)
    try:
        rc = int(_module(args._name).run(args) or 0)
        if args._name in REPORTS_PEAK:
            from .streaming import peak_line

            print(peak_line())
        return rc
    except (MixbitsError, ValueError, OSError, RuntimeError) as e:
        # The one place errors become output. Bad input (files, shapes,
        # budgets, settings, unwritable outputs): one clear line, no
        # traceback. MIXBITS_DEBUG=1 shows the traceback.
        if os.environ.get("MIXBITS_DEBUG"):
            raise
        print(f"mixbits {args._name}: error: {_message(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
