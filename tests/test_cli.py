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


@pytest.mark.parametrize("k", [128, 256, 1024])
def test_demo_runs_on_small_shapes(k, capsys):
    assert main(["demo", "--n", "32", "--k", str(k), "--m", "2"]) == 0
    out = capsys.readouterr().out
    assert "4-bit g64" in out and "4.500" in out


def test_demo_rejects_bad_k():
    with pytest.raises(SystemExit, match="multiple of 128"):
        main(["demo", "--k", "100"])
