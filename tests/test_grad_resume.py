"""Nothing of the gradient measure is lost to a kill (issue 40): the grad
stage checkpoints every rated tensor to its table and the Fisher pass's
block chain after every finished block, and a resume rates no tensor
twice, takes the backward on below the blocks already done and ends with
the uninterrupted run's table, bit for bit; a resume with other settings
is refused before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

import tiny_models  # noqa: E402
from killed_runs import kill_when, rerun_and_clean, table_kls  # noqa: E402
from mixbits.errors import UsageError  # noqa: E402
from mixbits.measure import fisher_blocks, grad  # noqa: E402
from mixbits.measure.two_stage import proxy_sweep  # noqa: E402

CANDS = ["2b_g64", "4b_g64"]
KW = dict(method="grad", samples=2, progress=False)


class Killed(Exception):
    pass


def _toks():
    return np.random.default_rng(5).integers(0, 160, (3, 12))  # two chunks of the Fisher pass


def _strip(table):
    """The table without its timings (the only thing a resume may change)."""
    meta = {k: v for k, v in table["meta"].items() if not k.endswith("_seconds")}
    return {**table, "meta": meta, "entries": [{k: v for k, v in e.items() if k != "seconds"}
                                               for e in table["entries"]]}


def _kill_after(monkeypatch, k):
    """Rating raises on its (k+1)-th call, as a kill would stop it; returns
    the list of paths rated."""
    rated = []
    real = grad._rate

    def rate(ad, s, *a, **kw):
        if len(rated) == k:
            raise Killed(s.path)
        rated.append(s.path)
        return real(ad, s, *a, **kw)

    monkeypatch.setattr(grad, "_rate", rate)
    return rated


def _count_stages(monkeypatch):
    """The blocks (None: the embedding and head) whose Fisher is formed."""
    stages = []

    class Counted(fisher_blocks._Stage):
        def __init__(self, adapter, sites):
            stages.append(sorted({s.block for s in sites}, key=lambda b: -1 if b is None else b))
            super().__init__(adapter, sites)

    monkeypatch.setattr(fisher_blocks, "_Stage", Counted)
    return stages


@pytest.mark.filterwarnings("ignore:the gradient .Fisher. pass runs on the whole model")
@pytest.mark.parametrize("fisher_pass", ["blocks", "whole"])
def test_killed_grad_measure_resumes_to_the_same_table(tmp_path, monkeypatch, fisher_pass):
    model, _ = tiny_models.build("llama")  # 4 blocks x 7 linears, embedding, head
    if fisher_pass == "whole":
        monkeypatch.setattr(fisher_blocks, "block_chain", lambda *a, **k: (None, "refused"))
    toks = _toks()
    full = proxy_sweep(model, toks, tmp_path / "full.json", CANDS, **KW)
    assert full["complete"] and len(full["entries"]) == 30
    assert not (tmp_path / "full.json.fisher.safetensors").exists()  # removed when done

    out = tmp_path / "t.json"
    k = 16  # blocks 3 and 2 (7 tensors each) and 2 tensors of block 1
    with monkeypatch.context() as m:
        first = _kill_after(m, k)
        with pytest.raises(Killed):
            proxy_sweep(model, toks, out, CANDS, **KW)
    part = json.loads(out.read_text())
    assert part["complete"] is False and part["grad_stage"]["fisher_pass"] == fisher_pass
    assert sorted(e["path"] for e in part["entries"]) == sorted(first)  # every rated tensor kept
    state = tmp_path / "t.json.fisher.safetensors"
    assert state.exists() == (fisher_pass == "blocks")

    with pytest.raises(FileExistsError):  # not without resume
        proxy_sweep(model, toks, out, CANDS, **KW)
    with monkeypatch.context() as m:
        again = _kill_after(m, 10 ** 6)
        stages = _count_stages(m)
        table = proxy_sweep(model, toks, out, CANDS, resume=True, **KW)
    assert not set(again) & set(first) and len(again) == 30 - k  # no tensor rated twice
    if fisher_pass == "blocks":
        # blocks 3 and 2 are done: the backward goes on from block 2's input
        assert stages == [[1], [0], [None]]
        assert not state.exists()
    assert _strip(table) == _strip(full)
    assert _strip(json.loads(out.read_text())) == _strip(full)


def test_a_kill_between_a_block_s_ratings_and_its_state_loses_only_that_block_s_fisher(
        tmp_path, monkeypatch):
    """The block chain's state is written after its block's tensors: a run
    killed after block 2's tensors were saved but before its state, found
    with block 3's state, forms block 2's Fisher again and rates nothing
    twice."""
    model, _ = tiny_models.build("llama")
    toks = _toks()
    full = proxy_sweep(model, toks, tmp_path / "full.json", CANDS, **KW)
    out = tmp_path / "t.json"
    saved = []
    real = fisher_blocks.save_cotangents

    def save(path, block, cots, key):
        if block == 2:
            raise Killed("before block 2's state")
        saved.append(block)
        real(path, block, cots, key)

    with monkeypatch.context() as m:
        m.setattr(fisher_blocks, "save_cotangents", save)
        with pytest.raises(Killed):
            proxy_sweep(model, toks, out, CANDS, **KW)
    assert saved == [3] and len(json.loads(out.read_text())["entries"]) == 14
    with monkeypatch.context() as m:
        again = _kill_after(m, 10 ** 6)
        stages = _count_stages(m)
        table = proxy_sweep(model, toks, out, CANDS, resume=True, **KW)
    assert stages == [[], [1], [0], [None]]  # block 2 again, with nothing of it to rate
    assert len(again) == 16
    assert _strip(table) == _strip(full)


def test_two_stage_resumes_its_grad_stage(tmp_path, monkeypatch):
    model, _ = tiny_models.build("llama")
    toks = _toks()
    kw = dict(method="two-stage", budget=0.3, targets=(3.6,), samples=2, progress=False)
    full = proxy_sweep(model, toks, tmp_path / "full.json", CANDS, **kw)
    out = tmp_path / "t.json"
    with monkeypatch.context() as m:
        first = _kill_after(m, 20)
        with pytest.raises(Killed):
            proxy_sweep(model, toks, out, CANDS, **kw)
    with monkeypatch.context() as m:
        again = _kill_after(m, 10 ** 6)
        table = proxy_sweep(model, toks, out, CANDS, resume=True, **kw)
    assert len(first) == 20 and len(again) == 10 and not set(first) & set(again)
    assert _strip(table) == _strip(full)


@pytest.mark.parametrize("change", [dict(samples=1), dict(seed=1), dict(candidates=["2b_g64"]),
                                    dict(tokens="other"), dict(model="other"),
                                    dict(method="two-stage")])
def test_a_resume_with_other_settings_is_refused_before_any_work(tmp_path, monkeypatch, change):
    model, _ = tiny_models.build("llama")
    toks = _toks()
    out = tmp_path / "t.json"
    with monkeypatch.context() as m:
        _kill_after(m, 9)
        with pytest.raises(Killed):
            proxy_sweep(model, toks, out, CANDS, **KW)
    before = out.read_bytes()

    def boom(*a, **k):
        raise AssertionError("work started")

    monkeypatch.setattr(grad, "grad_entries", boom)
    kw = {**KW, **change}
    cands = kw.pop("candidates", CANDS)
    if kw.pop("tokens", None):
        toks = toks[:, ::-1].copy()
    if kw.pop("model", None):
        model, _ = tiny_models.build("llama", seed=7)
    with pytest.raises(UsageError, match="different settings"):
        proxy_sweep(model, toks, out, cands, resume=True, **kw)
    assert out.read_bytes() == before


def test_measure_cli_resumes_the_grad_stage_and_checks_its_settings_first(tmp_path, monkeypatch,
                                                                          capsys):
    import mixbits
    from mixbits.cli import main

    model, cfg = tiny_models.build("llama")
    mixbits.save(model, tmp_path / "m", cfg)
    np.save(tmp_path / "t.npy", _toks())
    out = tmp_path / "g.json"
    argv = ["measure", "--model", str(tmp_path / "m"), "--tokens", str(tmp_path / "t.npy"),
            "--candidates", *CANDS, "--method", "grad", "--out", str(out)]
    with monkeypatch.context() as m:
        first = _kill_after(m, 12)
        with pytest.raises(Killed):
            main(argv)
    assert len(json.loads(out.read_text())["entries"]) == 12
    import mixbits.measure.calib as calib

    with monkeypatch.context() as m:
        def no_load(*a, **k):
            raise AssertionError("the model was loaded before the settings were checked")

        m.setattr(calib, "load_model_and_tokens", no_load)
        capsys.readouterr()
        assert main(argv + ["--resume", "--fisher-samples", "1"]) == 2
        assert 'fisher_samples: 2 in the file, 1 now' in capsys.readouterr().err
    with monkeypatch.context() as m:
        again = _kill_after(m, 10 ** 6)
        assert main(argv + ["--resume"]) == 0
    assert len(again) == 30 - 12 and not set(first) & set(again)
    assert json.loads(out.read_text())["complete"] is True


def test_convert_killed_in_its_grad_stage_continues_it(tmp_path):
    """A real `mixbits convert --method grad` SIGKILLed once the Fisher
    pass has finished a block; the same command then finishes, and its
    table equals an uninterrupted run's."""
    import mixbits

    model, cfg = tiny_models.build("llama")
    mixbits.save(model, tmp_path / "m", cfg)
    np.save(tmp_path / "t.npy", np.random.default_rng(3).integers(0, 160, (4, 24)))
    env = dict(os.environ, MIXBITS_NUM_THREADS="1")
    base = [sys.executable, "-m", "mixbits.cli", "convert", "--model", str(tmp_path / "m"),
            "--tokens", str(tmp_path / "t.npy"), "--bpw", "3.6", "--method", "grad",
            "--max-evals", "1", "--candidates", "wide"]
    killed = tmp_path / "killed"
    work = Path(str(killed) + ".work")
    state = work / "table.json.fisher.safetensors"
    proc = subprocess.Popen(base + ["--out", str(killed)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    kill_when(proc, state.exists, 300, "the grad stage")
    partial = json.loads((work / "table.json").read_text())
    assert partial["complete"] is False and 7 <= len(partial["entries"]) < 30
    clean = tmp_path / "clean"
    rerun_and_clean(base, killed, clean, env)
    done = table_kls(work / "table.json")
    assert done == table_kls(Path(str(clean) + ".work") / "table.json") and len(done) == 30
    for e in partial["entries"]:  # what the killed run rated is what the table holds
        assert {c["kind"]: c["kl"] for c in e["candidates"]} == done[e["path"]]
    assert not state.exists()


def test_tensors_left_to_the_exact_sweep_are_remembered(tmp_path, monkeypatch):
    """A model whose Fisher is not finite upstream of a saturated RG-LRU:
    those tensors go to the exact sweep after the proxy's ratings. Killed
    there, the resume rates nothing and measures only the tensors left."""
    from mixbits.measure import sweep as sweep_mod
    from test_grad_nonfinite import _saturated_recurrent_gemma

    model = _saturated_recurrent_gemma()
    toks = np.random.default_rng(0).integers(0, 160, (2, 12))
    cands = ["2b_g32", "4b_g64"]
    with pytest.warns(grad.ProxyFallbackWarning):
        full = proxy_sweep(model, toks, tmp_path / "full.json", cands, **KW)
    exact = [e["path"] for e in full["entries"] if "proxy_fallback" in e]
    assert len(exact) >= 2
    out = tmp_path / "t.json"
    measured = []
    real = sweep_mod.measure_site

    def measure(rp, site, *a, **k):
        if len(measured) == 1:
            raise Killed(site.path)
        measured.append(site.path)
        return real(rp, site, *a, **k)

    with monkeypatch.context() as m, pytest.warns(grad.ProxyFallbackWarning):
        m.setattr(sweep_mod, "measure_site", measure)
        with pytest.raises(Killed):
            proxy_sweep(model, toks, out, cands, **KW)
    part = json.loads(out.read_text())
    assert sorted(part["grad_stage"]["fallback"]) == sorted(exact)
    with monkeypatch.context() as m, pytest.warns(grad.ProxyFallbackWarning,
                                                 match=f"rate {len(exact) - 1} tensor"):
        again = _kill_after(m, 0)  # any rating would raise
        stages = _count_stages(m)
        measured2 = []
        m.setattr(sweep_mod, "measure_site", lambda rp, site, *a, **k: measured2.append(site.path)
                  or real(rp, site, *a, **k))
        table = proxy_sweep(model, toks, out, cands, resume=True, **KW)
    assert again == [] and stages == []  # no Fisher pass: every tensor is rated or left
    assert measured2 == [p for p in exact if p not in measured]
    assert _strip(table) == _strip(full)


@pytest.mark.filterwarnings("ignore:the gradient .Fisher. pass runs on the whole model")
@pytest.mark.parametrize("kill", ["rating 3", "rating 10", "block 2"])
def test_a_chain_broken_part_way_is_redone_whole_on_resume(tmp_path, monkeypatch, kill):
    """A model that writes into block 2's output: the block-wise pass rates
    block 3, finds the break at block 2 and redoes everything from the
    whole-model pass. Killed before the break was found (in block 3's
    ratings, or in block 2's backward with block 3's state saved) or after
    (in the whole-model ratings), the resume ends with the same table."""
    model, _ = tiny_models.llama_writing_into_block(2)
    toks = _toks()
    full = proxy_sweep(model, toks, tmp_path / "full.json", CANDS, **KW)
    out = tmp_path / "t.json"
    with monkeypatch.context() as m:
        if kill.startswith("rating"):
            _kill_after(m, int(kill.split()[1]))
        else:
            real = fisher_blocks._same_output

            def same(i, y, recorded):
                if i == 2:
                    raise Killed("in block 2's backward")
                real(i, y, recorded)

            m.setattr(fisher_blocks, "_same_output", same)
        with pytest.raises(Killed):
            proxy_sweep(model, toks, out, CANDS, **KW)
    part = json.loads(out.read_text())
    whole = kill == "rating 10"
    assert part["grad_stage"]["fisher_pass"] == ("whole" if whole else "blocks")
    kept = len(part["entries"])
    assert kept == {"rating 3": 3, "rating 10": 10 - 7, "block 2": 7}[kill]
    with monkeypatch.context() as m:
        again = _kill_after(m, 10 ** 6)
        table = proxy_sweep(model, toks, out, CANDS, resume=True, **KW)
    # the block-wise ratings are redone from the whole-model pass; the whole pass's are kept
    if whole:
        assert len(again) == 30 - kept and not set(again) & {e["path"] for e in part["entries"]}
    else:  # all 30 again once the break is found (what block 3 rated before it, too)
        assert len(set(again[-30:])) == 30
    assert _strip(table) == _strip(full)
