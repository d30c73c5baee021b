"""Subcommands of the ``mixbits`` command line (see mixbits.cli)."""
