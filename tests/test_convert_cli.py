"""``mixbits convert``: the whole pipeline in one command, on tiny models of
three architectures (dense, hybrid, MoE); a rerun after a kill continues;
settings, budgets and outputs checked before the model loads; --dry-run
writes nothing; several budgets share one measurement; Hugging Face repo
ids resolved offline from a hub cache laid out as the hub client lays it out."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from killed_runs import kill_when, rerun_and_clean, table_kls
from mixbits.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _folder(tmp_path_factory, arch, seq=4, length=24):
    import mixbits

    d = tmp_path_factory.mktemp(arch)
    model, cfg = tiny_models.build(arch)
    mixbits.save(model, d / "model", cfg)
    toks = np.random.default_rng(3).integers(0, 160, (seq, length))
    np.save(d / "tokens.npy", toks)
    return d


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return _folder(tmp_path_factory, "llama")


def _independent_logits(folder, allocation, tokens, calibration):
    """The allocation applied by `mixbits quantize`'s own functions to a
    fresh load of the source (``+search`` kinds fitted on the
    ``calibration`` tokens convert used, their layer inputs from the model
    as measure ran it): what the converted folder must hold."""
    from types import SimpleNamespace

    import mixbits
    from mixbits.commands.quantize import allocation_candidates, quantize_candidates
    from mixbits.measure.calib import load_model

    model, _, _ = mixbits.load(folder)
    measured, _ = load_model(SimpleNamespace(model=str(folder), dtype="float32"))
    quantize_candidates(model, allocation_candidates(allocation, model), tokens=calibration,
                        measured=measured)
    return model(mx.array(tokens))


@pytest.mark.parametrize("arch", ["llama", "qwen3_5_vlm", "qwen3_moe"])
def test_convert_end_to_end(arch, tmp_path_factory, tmp_path, capsys):
    import mixbits

    d = _folder(tmp_path_factory, arch)
    out = tmp_path / "q"
    argv = ["convert", "--model", str(d / "model"), "--tokens", str(d / "tokens.npy"),
            "--bpw", "3.6", "--out", str(out), "--max-evals", "3"]
    assert main(argv) == 0, capsys.readouterr().err
    shown = capsys.readouterr()
    printed = shown.out
    for stage in ("[1/4] calibration", "[2/4] measure", "[3/4] refine", "[4/4] quantize"):
        assert stage in printed
    assert "quantize: 100%" in shown.err  # the stage's bar of tensors built, through to the end
    alloc = json.loads((out / "allocation.json").read_text())
    assert alloc["average_bpw_storage"] <= 3.6 + 1e-9
    assert alloc["baselines"] and alloc["guard"]["joint_kl"] <= min(b["joint_kl"] for b in alloc["baselines"])
    card = (out / "README.md").read_text()
    assert "joint KL" in card and f"{alloc['average_bpw_storage']:.3f}" in card and "uniform" in card
    assert (out / "sensitivity.png").read_bytes()[:4] == b"\x89PNG"
    toks = np.load(d / "tokens.npy")[:2]
    model, _, _ = mixbits.load(out)
    got = model(mx.array(toks))
    want = _independent_logits(d / "model", alloc, toks, np.load(d / "tokens.npy"))
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
    # stock mlx-lm runs the folder too (through its model file when mixbits-only kinds are in it)
    from mlx_lm.utils import load_model  # mlx_lm.load without a tokenizer (these folders have none)

    stock, _ = load_model(out, trust_remote_code=True)
    assert mx.allclose(stock(mx.array(toks)), got, atol=1e-5, rtol=1e-5).item()
    # the work folder keeps every stage
    work = Path(str(out) + ".work")
    assert {p.name for p in work.iterdir()} >= {"settings.json", "tokens.npy", "table.json",
                                                "allocation_3.6bpw.json"}


def test_rerun_continues_and_skips_finished_stages(dense, tmp_path, capsys):
    out = tmp_path / "q"
    argv = ["convert", "--model", str(dense / "model"), "--tokens", str(dense / "tokens.npy"),
            "--bpw", "3.6", "--out", str(out), "--max-evals", "2"]
    assert main(argv) == 0
    first = (out / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "(kept from the last run)" in printed and "already written by the last run" in printed
    # the folder lost (a kill during the save): only the quantize stage runs again
    shutil.rmtree(out)
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("(kept from the last run)") == 3  # calibration, measure, refine
    assert (out / "model.safetensors").read_bytes() == first
    # other weights under the same path: the kept table is not theirs
    import mixbits

    model, cfg = tiny_models.build("llama", seed=5)
    mixbits.save(model, tmp_path / "other", cfg)
    shutil.copytree(Path(str(out) + ".work"), tmp_path / "o.work")
    argv2 = [a if a != str(dense / "model") else str(tmp_path / "other") for a in argv]
    argv2[argv2.index("--out") + 1] = str(tmp_path / "o")
    settings = json.loads((tmp_path / "o.work" / "settings.json").read_text())
    settings["model"] = str(tmp_path / "other")
    (tmp_path / "o.work" / "settings.json").write_text(json.dumps(settings))
    capsys.readouterr()
    assert main(argv2) == 2
    assert "is not the model" in capsys.readouterr().err


def test_killed_sweep_resumes_to_the_same_table(dense, tmp_path):
    """A real process SIGKILLed in the middle of the exact sweep; the same
    command then finishes, and its table equals an uninterrupted run's."""
    env = dict(os.environ, MIXBITS_NUM_THREADS="1")
    base = [sys.executable, "-m", "mixbits.cli", "convert", "--model", str(dense / "model"),
            "--tokens", str(dense / "tokens.npy"), "--bpw", "3.6", "--method", "exact",
            "--max-evals", "1", "--candidates", "wide"]
    killed = tmp_path / "killed"
    table = Path(str(killed) + ".work") / "table.json"
    proc = subprocess.Popen(base + ["--out", str(killed)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    kill_when(proc, lambda: table.exists() and not json.loads(table.read_text())["complete"],
              120, "the sweep")
    partial = json.loads(table.read_text())
    assert not partial["complete"] and not killed.exists()
    clean = tmp_path / "clean"
    rerun_and_clean(base, killed, clean, env)
    assert table_kls(table) == table_kls(Path(str(clean) + ".work") / "table.json")
    assert (killed / "allocation.json").read_text() == (clean / "allocation.json").read_text()


def test_storage_bpw_of_a_kind_is_what_its_layer_stores():
    from mixbits.adapter import ModelAdapter
    from mixbits.measure.candidates import build_layer, parse_candidate
    from mixbits.measure.sweep import storage_bits

    model, _ = tiny_models.build("llama")
    ad = ModelAdapter(model)
    site = next(s for s in ad.sites if s.form == "linear" and s.shape[1] % 128 == 0)
    for name in ("2b_g64", "3b_g32", "ternary_g64", "8b_g128", "mxfp4", "nvfp4", "mxfp8"):
        cand = parse_candidate(name)
        layer = build_layer(ad.get(site.path), cand, mx.float16)
        assert storage_bits(layer, site) / site.nparams == pytest.approx(cand.storage_bpw), name


def test_other_settings_are_refused_before_the_model_loads(dense, tmp_path, capsys, monkeypatch):
    out = tmp_path / "q"
    argv = ["convert", "--model", str(dense / "model"), "--tokens", str(dense / "tokens.npy"),
            "--bpw", "3.6", "--out", str(out), "--max-evals", "1"]
    assert main(argv) == 0
    import mixbits.models

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(mixbits.models, "load", no_load)
    monkeypatch.setattr(mixbits, "load", no_load)
    capsys.readouterr()
    assert main(argv[:-2] + ["--max-evals", "1", "--method", "grad"]) == 2
    err = capsys.readouterr().err
    assert "method: 'two-stage' then, 'grad' now" in err and "remove" in err
    # budgets below the narrowest candidate, repeated budgets, a file as the work folder
    assert main(argv[:7] + ["--bpw", "2.0", "--out", str(tmp_path / "x")]) == 2
    assert "narrowest candidate" in capsys.readouterr().err
    # the narrowest candidate counted as stored: fp modes carry one uint8 scale per group
    assert main(argv[:7] + ["--bpw", "4.2", "--candidates", "mxfp4", "nvfp4", "--out",
                            str(tmp_path / "x")]) == 2
    assert "mxfp4, 4.25 bits" in capsys.readouterr().err
    assert main(argv[:7] + ["--bpw", "3.6", "3.6", "--out", str(tmp_path / "x")]) == 2
    assert "repeated" in capsys.readouterr().err
    assert main(["convert", "--model", str(tmp_path / "nope"), "--bpw", "3.6", "--out", str(tmp_path / "z")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert not (tmp_path / "z.work").exists()
    (tmp_path / "y.work").write_text("")
    assert main(argv[:7] + ["--bpw", "3.6", "--out", str(tmp_path / "y")]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_dry_run_prints_the_plan_and_writes_nothing(dense, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["convert", "--model", str(dense / "model"), "--tokens", str(dense / "tokens.npy"),
                 "--bpw", "3.6", "4.5", "--out", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "quantizable tensors" in printed and "estimated: measure ~" in printed
    assert f"would write {out / '3.6bpw'}" in printed and f"would write {out / '4.5bpw'}" in printed
    assert list(tmp_path.iterdir()) == []


def test_several_budgets_share_one_measurement(dense, tmp_path, capsys):
    import mixbits

    out = tmp_path / "q"
    assert main(["convert", "--model", str(dense / "model"), "--tokens", str(dense / "tokens.npy"),
                 "--bpw", "4.5", "3.6", "--out", str(out), "--max-evals", "2"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("[2/4] measure") == 1
    bpw = {}
    for b in ("3.6", "4.5"):
        a = json.loads((out / f"{b}bpw" / "allocation.json").read_text())
        assert a["average_bpw_storage"] <= float(b) + 1e-9
        bpw[b] = a["average_bpw_storage"]
        mixbits.load(out / f"{b}bpw")
    assert bpw["3.6"] < bpw["4.5"]


def _hub_cache(root: Path, repo: str, files: Path) -> None:
    """A Hugging Face hub cache holding ``repo`` at one commit, as the hub
    client lays it out: blobs, a snapshot of links to them, refs/main."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    base = root / ("models--" + repo.replace("/", "--"))
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (base / "blobs").mkdir()
    for f in files.iterdir():
        blob = base / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)


def test_hf_repo_id_resolves_offline_through_mlx_lm(dense, tmp_path):
    hub = tmp_path / "hub"
    _hub_cache(hub, "tiny-org/tiny-llama", dense / "model")
    env = dict(os.environ, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1", MIXBITS_NUM_THREADS="1")
    out = tmp_path / "q"
    r = subprocess.run([sys.executable, "-m", "mixbits.cli", "convert", "--model", "tiny-org/tiny-llama",
                        "--tokens", str(dense / "tokens.npy"), "--bpw", "3.6", "--out", str(out),
                        "--dry-run"], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "30 quantizable tensors" in r.stdout
    r = subprocess.run([sys.executable, "-m", "mixbits.cli", "convert", "--model", "tiny-org/missing",
                        "--tokens", str(dense / "tokens.npy"), "--bpw", "3.6", "--out", str(out)],
                       env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "tiny-org/missing" in r.stderr and "HF_HUB_OFFLINE" in r.stderr


def test_time_budget_picks_the_most_exact_method_that_fits(dense, tmp_path, capsys):
    base = ["convert", "--model", str(dense / "model"), "--tokens", str(dense / "tokens.npy"),
            "--bpw", "3.6", "--max-evals", "1"]
    # a generous budget: the exact sweep fits
    out = tmp_path / "a"
    assert main(base + ["--out", str(out), "--time-budget", "600"]) == 0
    printed = capsys.readouterr().out
    assert "method: exact (projected" in printed and "[2/4] measure: exact" in printed
    # the probe's costs and the picked method's stage estimates, to set the measured stages against
    assert "probe: timed on one sequence: Fisher pass " in printed
    assert printed.count("estimated: measure ~") == 1
    assert json.loads((Path(str(out) + ".work") / "settings.json").read_text())["method"] == "exact"
    assert json.loads((Path(str(out) + ".work") / "table.json").read_text())["meta"]["method"] == "exact"
    # a rerun keeps the first run's choice, whatever the budget now (no probe)
    assert main(base + ["--out", str(out), "--time-budget", "1e-9"]) == 0
    printed = capsys.readouterr().out
    assert "method:" not in printed and "(kept from the last run)" in printed
    assert "estimated:" not in printed and "probe:" not in printed
    # nothing fits: the cheapest runs, with a one-line warning
    out = tmp_path / "b"
    assert main(base + ["--out", str(out), "--time-budget", "1e-9"]) == 0
    cap = capsys.readouterr()
    assert "method: grad (projected" in cap.out
    assert "mixbits convert: warning: no method is projected to fit --time-budget" in cap.err
    # --method wins over the budget; a bad budget is refused before the model loads
    out = tmp_path / "c"
    assert main(base + ["--out", str(out), "--time-budget", "1e-9", "--method", "two-stage"]) == 0
    assert "method: " not in capsys.readouterr().out
    assert main(base + ["--out", str(tmp_path / "d"), "--time-budget", "-1"]) == 2
    assert "positive number of minutes" in capsys.readouterr().err


def test_time_budget_lowers_refines_evaluations_when_no_method_fits():
    """plan_for_budget against the probe's own stage projections: the
    largest number of joint evaluations whose projected total fits."""
    from mixbits.convert import Probe, plan_for_budget

    probe = Probe(n_seq=8, fisher_seq=1.0, pair=(0.5, 0.1), pair_units=[10] * 100, joint_seq=2.0)
    args = dict(bpws=[3.5], max_evals=30, exact_budget=0.15, samples=2)

    def total(method, evals):
        return sum(probe.stage_seconds(method, args["bpws"], evals, args["exact_budget"],
                                       args["samples"]).values())

    assert total("exact", 30) > total("two-stage", 30) > total("grad", 30)
    generous = plan_for_budget(probe, **args, budget_s=total("exact", 30) + 1)
    assert (generous.method, generous.max_evals, generous.fits) == ("exact", 30, True)
    middle = plan_for_budget(probe, **args, budget_s=total("grad", 30) + 1)
    assert (middle.method, middle.max_evals, middle.fits) == ("grad", 30, True)
    for budget in (total("grad", 13) + 0.5, total("grad", 2)):
        plan = plan_for_budget(probe, **args, budget_s=budget)
        assert plan.method == "grad" and plan.fits and 1 <= plan.max_evals < 30
        assert total("grad", plan.max_evals) <= budget < total("grad", plan.max_evals + 1)
    hopeless = plan_for_budget(probe, **args, budget_s=total("grad", 1) - 1)
    assert (hopeless.method, hopeless.max_evals, hopeless.fits) == ("grad", 1, False)


def test_time_budget_rerun_keeps_the_lowered_evaluations(dense, tmp_path, capsys, monkeypatch):
    import mixbits.convert as conv

    base = ["convert", "--model", str(dense / "model"), "--tokens", str(dense / "tokens.npy"),
            "--bpw", "3.6", "--max-evals", "3", "--time-budget", "5", "--out", str(tmp_path / "q")]
    monkeypatch.setattr(conv, "plan_for_budget",
                        lambda probe, *a, **k: conv.Plan("grad", 1, True, {m: 1.0 for m in conv.METHODS}))
    assert main(base) == 0
    printed = capsys.readouterr().out
    assert "refine: 1 joint evaluations per budget instead of 3" in printed
    saved = json.loads((tmp_path / "q.work" / "settings.json").read_text())
    assert (saved["method"], saved["max_evals"]) == ("grad", 1)
    monkeypatch.undo()
    shutil.rmtree(tmp_path / "q")  # the work folder stays: a rerun continues from it
    assert main(base) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "(kept from the last run)" in printed and "method:" not in printed
