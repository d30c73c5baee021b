"""The documentation stays true to the code: docs/cli.md is what
docs/gen_cli.py writes from the parsers now, every `mixbits ...` command
shown in the README and docs/ parses with that command's real parser, and
relative links point at files that exist."""

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from mixbits.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]


def _gen_cli():
    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_reference_is_current():
    fresh = _gen_cli().render()
    assert (ROOT / "docs" / "cli.md").read_text() == fresh, "docs/cli.md is stale: run python docs/gen_cli.py"
    for name in COMMANDS:  # every command, whatever COMMANDS holds
        assert f"\n## mixbits {name}\n" in fresh


def test_readme_is_a_short_guide():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)


def _commands(page: Path):
    """`mixbits ...` command lines of the page's bash blocks, continuation
    lines joined and trailing comments dropped."""
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("mixbits "):
                yield line


@pytest.mark.parametrize("page", [p for p in PAGES if p.parent != ROOT / "bench"], ids=lambda p: p.name)
def test_shown_commands_parse(page, capsys):
    n = 0
    for line in _commands(page):
        argv = shlex.split(line)[1:]
        assert argv and argv[0] in COMMANDS, line
        try:
            build_parser(argv).parse_args(argv)
        except SystemExit:
            pytest.fail(f"{page.name}: `{line}` does not parse: {capsys.readouterr().err.strip()}")
        n += 1
    if page.name == "README.md":
        assert n >= 4  # convert and the three steps at least


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_exist(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.relative_to(ROOT)} links to missing {target}"
