"""The mixbits command's errors: one line from one place (mixbits.cli),
arguments checked before anything slow runs, --version."""

import json

import pytest

from mixbits.cli import main
from mixbits.errors import FormatError, MixbitsError
from shared_files import MEAS


def tiny_table(n_layers=2):
    entries = [{"path": f"model.layers.{i}.mlp.up_proj", "layer": i, "nparams": 4096,
                "candidates": [{"kind": "3b_g64", "bits": 3, "kl": 0.2 + i, "storage_bits": 14336},
                               {"kind": "4b_g64", "bits": 4, "kl": 0.1 + i, "storage_bits": 18432}]}
               for i in range(n_layers)]
    return {"format": "mixbits.sensitivity", "version": 1, "complete": True, "entries": entries}


def test_version(capsys):
    import mixbits

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"mixbits {mixbits.__version__}"


def test_one_hierarchy():
    from mixbits.alloc import InfeasibleBudget
    from mixbits.models import Unavailable

    for cls in (FormatError, InfeasibleBudget, Unavailable):
        assert issubclass(cls, MixbitsError)
    assert issubclass(FormatError, ValueError) and issubclass(InfeasibleBudget, ValueError)


def _one_line_error(capsys, argv, *needles):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


def test_directory_as_input_or_config(tmp_path, capsys):
    t = tmp_path / "t.json"
    t.write_text(json.dumps(tiny_table()))
    _one_line_error(capsys, ["allocate", str(tmp_path), "--bpw", "4", "--out", str(tmp_path / "a.json")],
                    "is a directory")
    _one_line_error(capsys, ["allocate", str(MEAS), "--bpw", "4", "--config", str(tmp_path),
                             "--out", str(tmp_path / "a.json")], "is a directory")


def test_deeply_nested_json_is_a_format_error(tmp_path, capsys):
    t = tmp_path / "deep.json"
    t.write_text("[" * 100000 + "]" * 100000)
    _one_line_error(capsys, ["allocate", str(t), "--bpw", "4", "--out", str(tmp_path / "a.json")],
                    "nested too deeply")


def _table_file(tmp_path):
    t = tmp_path / "table.json"
    t.write_text(json.dumps(tiny_table()))
    return t


# --model names nothing: an argument checked only after the model load would
# report the missing model instead of itself.
NO_MODEL = "/nonexistent/model"


def test_refine_rejects_a_measurement(tmp_path, capsys):
    _one_line_error(capsys, ["refine", str(MEAS), "--model", NO_MODEL, "--bpw", "3.5",
                             "--out", str(tmp_path / "a.json")], "ExLlamaV2 measurement")


@pytest.mark.parametrize("argv,needle", [
    (["--max-evals", "0"], "--max-evals must be >= 1"),
    (["--max-evals", "-3"], "--max-evals must be >= 1"),
    (["--n-seq", "0"], "--n-seq must be >= 1"),
    (["--seq-len", "1"], "--seq-len must be >= 2"),
    (["--bpw", "nan"], "--bpw must be a positive"),
    (["--low-bpw", "4"], "--low-bpw 4.0 is above --bpw"),
    (["--text", "/nonexistent.txt"], "--text: no such file"),
])
def test_refine_arguments_checked_before_the_model_loads(tmp_path, capsys, argv, needle):
    _one_line_error(capsys, ["refine", str(_table_file(tmp_path)), "--model", NO_MODEL, "--bpw", "3.5",
                             "--out", str(tmp_path / "a.json")] + argv, needle)


@pytest.mark.parametrize("argv,needle", [
    (["--max-evals", "0"], "--max-evals must be >= 1"),
    (["--holdout-seq", "-1"], "--holdout-seq must be >= 0"),
    (["--bpw", "3.5", "-1"], "--bpw must be a positive"),
    (["--n-seq", "0"], "--n-seq must be >= 1"),
])
def test_compare_arguments_checked_before_the_model_loads(tmp_path, capsys, argv, needle):
    _one_line_error(capsys, ["compare", str(_table_file(tmp_path)), "--model", NO_MODEL] + argv, needle)


def test_compare_rejects_a_measurement(capsys):
    _one_line_error(capsys, ["compare", str(MEAS), "--model", NO_MODEL], "ExLlamaV2 measurement")


def test_quantize_out_checked_before_the_model_loads(tmp_path, capsys):
    from shared_files import ALLOC

    f = tmp_path / "file"
    f.write_text("not a folder")
    _one_line_error(capsys, ["quantize", "--model", NO_MODEL, "--allocation", str(ALLOC), "--out", str(f)],
                    "mixbits quantize: error:", "not a folder")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    _one_line_error(capsys, ["quantize", "--model", NO_MODEL, "--allocation", str(ALLOC), "--out", str(other)],
                    "did not write")
    _one_line_error(capsys, ["quantize", "--model", NO_MODEL, "--allocation", str(tmp_path), "--out", str(other)],
                    "mixbits quantize: error: --allocation:", "is a directory")
