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


def test_bench_times_the_chosen_contract(tmp_path, capsys, monkeypatch):
    # `mixbits bench --activations int16` must time the int16 path: the JSON
    # records it, and every call reaches qmatmul with that contract.
    import json

    import mixbits

    seen = []
    real = mixbits.qmatmul

    def spy(x, qt, **kw):
        seen.append(kw.get("activations", "float"))
        return real(x, qt, **kw)

    monkeypatch.setattr(mixbits, "qmatmul", spy)
    out = tmp_path / "b.json"
    assert main(["bench", "--shapes", "64x128", "--m", "1", "--kinds", "4bit", "--no-baselines",
                 "--min-time", "0.01", "--activations", "int16", "--json", str(out)]) == 0
    assert seen and set(seen) == {"int16"}
    assert any("int16" in n for n in json.loads(out.read_text())["notes"])


def test_bench_with_an_integer_contract_runs_on_the_cpu_from_a_gpu_default(tmp_path, monkeypatch):
    """mixbits bench --activations int8 where the default device is the GPU
    (a Mac): every timed call runs with the CPU as the default device, and
    the JSON's notes say so."""
    import json

    import mlx.core as mx

    import mixbits
    from test_decode import FakeGPUDefault

    fake = FakeGPUDefault(monkeypatch)
    seen = []
    real = mixbits.qmatmul
    monkeypatch.setattr(mixbits, "qmatmul", lambda x, qt, **kw: seen.append(fake.device) or real(x, qt, **kw))
    out = tmp_path / "b.json"
    assert main(["bench", "--shapes", "64x128", "--m", "1", "--kinds", "4bit", "--no-baselines",
                 "--min-time", "0.01", "--activations", "int8", "--json", str(out)]) == 0
    assert seen and set(seen) == {mx.cpu}
    assert any("runs on the CPU" in n for n in json.loads(out.read_text())["notes"])


def test_bench_records_the_page_policy(tmp_path, monkeypatch):
    # Cold times depend on the huge-page policy, so the JSON's machine
    # record says which was in force: the bracketed THP mode, or None
    # where the file is missing; GLIBC_TUNABLES as set.
    import json

    from mixbits.commands.bench import THP_POLICY, page_policy

    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    assert page_policy(str(f)) == {"transparent_hugepage": "madvise",
                                   "glibc_tunables": "glibc.malloc.hugetlb=1"}
    f.write_text("[never] madvise always\n")
    assert page_policy(str(f))["transparent_hugepage"] == "never"
    assert page_policy(str(tmp_path / "missing"))["transparent_hugepage"] is None
    monkeypatch.delenv("GLIBC_TUNABLES")
    out = tmp_path / "b.json"
    assert main(["bench", "--shapes", "64x128", "--m", "1", "--kinds", "4bit", "--no-baselines",
                 "--min-time", "0.01", "--json", str(out)]) == 0
    pages = json.loads(out.read_text())["machine"]["pages"]
    assert pages == page_policy(THP_POLICY) and pages["glibc_tunables"] is None
