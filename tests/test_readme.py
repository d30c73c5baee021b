"""The README's examples run as written: the two first-run commands are
what CI runs, the allocate examples (docs/measuring.md) run on the shipped
data, and the Python examples run (the model one on SmolLM2 from PyPI)."""

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from mixbits.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang, text=README):
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _first_commands():
    return [line.split("  #")[0].strip() for line in _blocks("bash")[0].strip().splitlines()]


def test_ci_runs_exactly_the_readme_first_commands():
    cmds = _first_commands()
    assert len(cmds) == 2 and "mixbits demo" in cmds[0] and "pytest tests" in cmds[1]
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert cmds[0] in ci and cmds[1] in ci
    # the test command must not reinstall (and so rebuild) the package
    assert "pip install ." not in cmds[1] and ".[test]" not in cmds[1]


def test_ci_keeps_the_stock_pip():
    """CI checks the README with the pip that `python3 -m venv` gives (pip 23
    has no `--group`), so .ci/run must not upgrade pip."""
    ci = (ROOT / ".ci" / "run").read_text()
    code = [ln.split("#")[0] for ln in ci.splitlines()]
    assert "python3 -m venv" in ci
    for ln in code:
        words = ln.split()
        if "install" in words and ("-U" in words or "--upgrade" in words):
            assert "pip" not in words[words.index("install") + 1:], ln
    assert "--group" not in " ".join(code + _first_commands())


def test_test_requirements_have_one_source():
    """tests/requirements.txt lists the test dependencies; pyproject.toml
    neither repeats them nor names mixbits there (which would rebuild it)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    reqs = [ln.split("#")[0].strip() for ln in (ROOT / "tests" / "requirements.txt").read_text().splitlines()]
    names = {re.split(r"[<>=!~;\[ ]", r)[0].lower() for r in reqs if r}
    assert names and "mixbits" not in names and not any(r.startswith((".", "-e")) for r in reqs if r)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "dependency-groups" not in project
    runtime = {re.split(r"[<>=!~;\[ ]", d)[0].lower() for d in project["project"]["dependencies"]}
    assert not names & runtime, names & runtime
    assert "tests/requirements.txt" in _first_commands()[1]


def test_allocate_examples_run_as_written(tmp_path, monkeypatch, capsys):
    from test_cli_errors import tiny_table

    shutil.copytree(ROOT / "tests" / "data", tmp_path / "tests" / "data")
    (tmp_path / "table.json").write_text(json.dumps(tiny_table()))  # what `mixbits measure` would write
    monkeypatch.chdir(tmp_path)
    guide = (ROOT / "docs" / "measuring.md").read_text()
    lines = [ln for b in _blocks("bash", guide) for ln in b.splitlines() if ln.startswith("mixbits allocate")]
    assert len(lines) == 3
    for line in lines:
        argv = shlex.split(line)[1:]
        assert main(argv) == 0, (line, capsys.readouterr().err)
        out = argv[argv.index("--out") + 1]
        assert json.loads(Path(out).read_text())


def test_python_quantize_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = _blocks("python")[0]
    assert "mixbits.quantize(" in code
    exec(compile(code, "README.md", "exec"), {})


def test_python_model_example_runs(tmp_path, monkeypatch, capsys):
    from mixbits.models import Unavailable

    monkeypatch.chdir(tmp_path)
    code = _blocks("python")[1]
    assert "mixbits.save(" in code
    try:
        exec(compile(code, "README.md", "exec"), {})
    except Unavailable as e:  # listed by -rs, never silent
        pytest.skip(f"SmolLM2 GGUF cannot be downloaded here: {e}")
    assert "Paris" in capsys.readouterr().out
    assert (tmp_path / "smollm2-mixed" / "mixbits_manifest.json").is_file()
