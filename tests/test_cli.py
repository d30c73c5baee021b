"""Every subcommand listed by `mixbits --help` has a module and a --help."""

import pytest

from mixbits.cli import COMMANDS, main


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_subcommand_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    assert "usage: " in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
