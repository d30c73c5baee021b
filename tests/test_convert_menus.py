"""``mixbits convert`` refines with both candidate menus by default (the
extended menu measured once, refine run with each menu on the same
calibration tokens) and keeps the allocation with the lower calibration
joint KL. Checked against an independent evaluation -- the model's own
forward with every assigned weight replaced by mx.dequantize of a layer
built afresh, KL in float64 numpy -- not against the evaluator's numbers;
``--menu default`` is the one-menu pipeline as it was (the default table,
one refine); a bad --menu is refused before any work. The menus' kinds are
built by ``--quantizer`` (default ``search``; the menu tests use ``rtn``,
whose layers need no calibration inputs to rebuild)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import tiny_models
from mixbits.cli import main


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    import mixbits

    d = tmp_path_factory.mktemp("menus")
    model, cfg = tiny_models.build("llama")
    mixbits.save(model, d / "model", cfg)
    np.save(d / "tokens.npy", np.random.default_rng(3).integers(0, 160, (4, 24)))
    return d


def _log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def independent_kl(folder, allocation, tokens) -> float:
    """Mean per-token KL(P_float || Q) on ``tokens``: the source loaded
    afresh, each assigned weight replaced by mx.dequantize of a layer built
    for its kind (scales widened to float32, segments joined, the column
    permutation undone), the model's own forward."""
    import mixbits
    from mixbits.measure.candidates import build_layer, parse_candidate

    model, _, _ = mixbits.load(folder)
    x = mx.array(tokens)
    ref = np.array(model(x).astype(mx.float32), dtype=np.float64)
    mods = dict(model.named_modules())
    dense = {}
    for a in allocation["assignment"]:
        target = mods[a["path"]]
        assert isinstance(target, (nn.Linear, nn.Embedding)), type(target)
        layer = build_layer(target, parse_candidate(a["kind"]), mx.float16)
        parts = [mx.dequantize(w, scales=s.astype(mx.float32), biases=b.astype(mx.float32),
                               group_size=gs, bits=bits)
                 for (w, s, b), (bits, gs, _) in zip(layer._triplets(), layer.layout.specs)]
        w = mx.concatenate(parts, axis=-1)
        if layer.layout.has_perm:  # stored columns are w[:, perm]
            w = mx.take(w, mx.argsort(layer["perm"]), axis=-1)
        dense[a["path"]] = w.astype(target.weight.dtype)
    for path, w in dense.items():  # after every build: a tied head reads the embedding's weight
        mods[path].weight = w
    out = np.array(model(x).astype(mx.float32), dtype=np.float64)
    p, q = _log_softmax(ref), _log_softmax(out)
    return float((np.exp(p) * (p - q)).sum(axis=-1).mean())


def _misleading(kind: str, factor: float):
    """A measurement whose table understates ``kind``'s KL by ``factor``
    (file and returned table alike): the extended menu's search, trusting
    it, lands above what the default menu reaches, so the default menu wins."""
    import mixbits.measure.two_stage as two_stage

    real = two_stage.proxy_sweep

    def sweep(model, tokens, path, *a, **k):
        table = real(model, tokens, path, *a, **k)
        for e in table["entries"]:
            for c in e["candidates"]:
                if c["kind"] == kind:
                    c["kl"] *= factor
        Path(path).write_text(json.dumps(table))
        return table

    return sweep


@pytest.mark.parametrize("bpw,understated,winner", [("3.6", None, "extended"), ("4.5", "3b_g32", "default")])
def test_the_kept_allocation_has_the_lower_calibration_kl(dense, tmp_path, capsys, monkeypatch, bpw,
                                                          understated, winner):
    import mixbits
    import mixbits.measure.two_stage as two_stage
    from mixbits.measure.candidates import CONVERT_MENUS, expand_candidates
    from mixbits.measure.joint import JointEvaluator
    from mixbits.measure.refine import refine, restrict_table

    if understated:
        monkeypatch.setattr(two_stage, "proxy_sweep", _misleading(understated, 0.01))
    tokens = np.load(dense / "tokens.npy")
    out = tmp_path / "q"
    assert main(["convert", "--model", str(dense / "model"), "--tokens", str(dense / "tokens.npy"),
                 "--bpw", bpw, "--out", str(out), "--max-evals", "3", "--method", "grad", "--quantizer", "rtn"]) == 0, \
        capsys.readouterr().err
    printed = capsys.readouterr().out
    work = Path(str(out) + ".work")
    settings = json.loads((work / "settings.json").read_text())
    assert settings["candidates"] == expand_candidates(CONVERT_MENUS["extended"])  # measured once: the superset
    alloc = json.loads((out / "allocation.json").read_text())
    menu = alloc["menu"]
    runs = {m: json.loads((work / f"allocation_{bpw}bpw.{m}.json").read_text()) for m in ("default", "extended")}
    # both menus' calibration KLs recorded, each what an independent evaluation gives its allocation
    want = {m: independent_kl(dense / "model", a, tokens) for m, a in runs.items()}
    for m in runs:
        assert menu["calibration_joint_kl"][m] == pytest.approx(want[m], rel=2e-3)
        assert {a["kind"] for a in runs[m]["assignment"]} <= set(CONVERT_MENUS[m])
    assert abs(want["default"] - want["extended"]) > 0.02 * min(want.values())  # a real choice
    best = min(want, key=want.get)
    assert best == winner  # the case is the one meant
    assert menu["kept"] == best
    assert alloc["assignment"] == runs[best]["assignment"]
    assert independent_kl(dense / "model", alloc, tokens) == pytest.approx(min(want.values()), rel=2e-3)
    assert f"candidate menu: {best} kept" in printed  # the printed summary and the card say it
    assert f"candidate menu: {best} kept" in (out / "README.md").read_text()
    # the default menu's search is the one refining with it alone runs (all --max-evals, same tokens)
    table = json.loads((work / "table.json").read_text())
    model, _, _ = mixbits.load(dense / "model")
    alone = refine(restrict_table(table, CONVERT_MENUS["default"]), JointEvaluator(model, tokens, chunk=4),
                   float(bpw), max_evals=3, progress=False)
    assert alone["assignment"] == runs["default"]["assignment"]
    assert alone["guard"]["joint_kl"] == pytest.approx(menu["calibration_joint_kl"]["default"], rel=1e-5)


def _same(a, b, where="allocation"):
    """Equal JSON, floats to rel 1e-5 (an evaluation reusing stored block
    outputs rounds differently in float32 than a fresh one)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, a, b)
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and not isinstance(b, bool):
        assert b == pytest.approx(a, rel=1e-5), where
    else:
        assert a == b, where


def test_menu_default_is_the_one_menu_pipeline(dense, tmp_path, capsys):
    import mixbits
    from mixbits.measure.candidates import DEFAULT_CANDIDATES
    from mixbits.measure.joint import JointEvaluator
    from mixbits.measure.refine import refine

    out = tmp_path / "q"
    assert main(["convert", "--model", str(dense / "model"), "--tokens", str(dense / "tokens.npy"),
                 "--bpw", "3.6", "--out", str(out), "--max-evals", "3", "--menu", "default",
                 "--quantizer", "rtn"]) == 0
    work = Path(str(out) + ".work")
    settings = json.loads((work / "settings.json").read_text())
    assert settings["candidates"] == list(DEFAULT_CANDIDATES) and "menus" not in settings
    assert sorted(p.name for p in work.glob("allocation_*")) == ["allocation_3.6bpw.json"]
    alloc = json.loads((out / "allocation.json").read_text())
    assert "menu" not in alloc
    # the old refine stage, run by hand on the stage's own table and tokens
    table = json.loads((work / "table.json").read_text())
    assert table["meta"]["candidates"] == list(DEFAULT_CANDIDATES)
    model, _, _ = mixbits.load(dense / "model")
    old = refine(table, JointEvaluator(model, np.load(work / "tokens.npy"), chunk=4), 3.6, max_evals=3,
                 progress=False)
    _same(old, alloc)
    # --candidates default: the same run (the same work folder settings)
    out2 = tmp_path / "q2"
    assert main(["convert", "--model", str(dense / "model"), "--tokens", str(dense / "tokens.npy"),
                 "--bpw", "3.6", "--out", str(out2), "--max-evals", "3", "--candidates", "default"]) == 0
    assert (out2 / "allocation.json").read_text() == (out / "allocation.json").read_text()
    assert json.loads((Path(str(out2) + ".work") / "settings.json").read_text()) == settings


def test_bad_menu_is_refused_before_any_work(dense, tmp_path, capsys, monkeypatch):
    import mixbits
    import mixbits.models

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(mixbits.models, "load", no_load)
    monkeypatch.setattr(mixbits, "load", no_load)
    base = ["convert", "--model", str(dense / "model"), "--tokens", str(dense / "tokens.npy"), "--bpw", "3.6",
            "--out", str(tmp_path / "q")]
    with pytest.raises(SystemExit) as e:
        main(base + ["--menu", "wide"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--menu: invalid choice: 'wide'" in err and "'both'" in err
    assert main(base + ["--menu", "extended", "--candidates", "2b_g64", "4b_g64"]) == 2
    assert "--menu extended and --candidates: give one" in capsys.readouterr().err
    assert main(base + ["--quantizer", "rtn", "--candidates", "2b_g64", "4b_g64"]) == 2
    assert "--quantizer rtn and --candidates: give one" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_rerun_after_a_kill_continues_with_the_next_menu(dense, tmp_path, capsys, monkeypatch):
    """The default menu's search kept in the work folder, the rest lost:
    the rerun refines the extended menu only and keeps the same result."""
    import mixbits.measure.refine as refine_mod

    out = tmp_path / "q"
    argv = ["convert", "--model", str(dense / "model"), "--tokens", str(dense / "tokens.npy"), "--bpw", "5",
            "--out", str(out), "--max-evals", "2", "--quantizer", "rtn"]
    assert main(argv) == 0
    work = Path(str(out) + ".work")
    first = (out / "allocation.json").read_text()
    import shutil

    shutil.rmtree(out)
    (work / "allocation_5bpw.json").unlink()
    (work / "allocation_5bpw.extended.json").unlink()
    calls = []
    real = refine_mod.refine

    def counting(table, *a, **k):
        calls.append({c["kind"] for e in table["entries"] for c in e["candidates"]})
        return real(table, *a, **k)

    monkeypatch.setattr(refine_mod, "refine", counting)
    capsys.readouterr()
    assert main(argv) == 0
    assert len(calls) == 1 and "5b_g64" in calls[0]  # the extended menu's search only
    assert (out / "allocation.json").read_text() == first


def test_refine_projection_counts_every_menus_search():
    from mixbits.convert import GUARD_EVALS, REUSE, Probe

    one = Probe(n_seq=8, fisher_seq=1.0, pair=(0.5, 0.1), pair_units=[10], joint_seq=2.0,
                reference_seq=3.0, build_set=5.0, candidates=10)
    two = Probe(n_seq=8, fisher_seq=1.0, pair=(0.5, 0.1), pair_units=[10], joint_seq=2.0,
                reference_seq=3.0, build_set=5.0, candidates=10, refines=2)
    # one reference pass; 2 sets of layers per search; per search the first evaluation and the
    # guard's 4 whole, the 29 later ones at REUSE of one (the evaluator's reuse), each 8 x 2 s
    evals = 1 + GUARD_EVALS + 29 * REUSE
    assert GUARD_EVALS == 4
    assert one.refine_seconds([3.5], 30) == 8 * 3.0 + 2 * 5.0 + evals * 8 * 2.0
    assert two.refine_seconds([3.5], 30) == 8 * 3.0 + 4 * 5.0 + 2 * evals * 8 * 2.0
    assert two.refine_seconds([3.5, 4.5, 5.0], 30) == 8 * 3.0 + 10 * 5.0 + 2 * 3 * evals * 8 * 2.0


def test_the_probe_projects_one_search_per_menu(dense, tmp_path, capsys, monkeypatch):
    """The dry run's (and --time-budget's) projection counts a search per
    menu: timing_probe is told how many, and the plan names the menus."""
    import mixbits.convert as conv

    seen = []
    real = conv.timing_probe

    def probe(*a, **k):
        p = real(*a, **k)
        seen.append(p.refines)
        return p

    monkeypatch.setattr(conv, "timing_probe", probe)
    base = ["convert", "--model", str(dense / "model"), "--tokens", str(dense / "tokens.npy"), "--bpw", "3.6",
            "--out", str(tmp_path / "q"), "--dry-run"]
    assert main(base) == 0
    printed = capsys.readouterr().out
    assert "menus: refine runs once per menu at each budget (default: 2b_g64" in printed
    assert main(base + ["--menu", "default"]) == 0
    assert "menus:" not in capsys.readouterr().out
    assert main(base + ["--menu", "extended"]) == 0
    assert seen == [2, 1, 1]
    assert not list(tmp_path.iterdir())


def test_default_quantizer_is_search_and_what_it_saves_scores_lower(dense, tmp_path, capsys):
    """Without --quantizer the menus' kinds are ``+search``: the written
    folder, loaded afresh and run by the model's own forward, gives the
    calibration KL the allocation reports (float64 numpy KL against the float
    model), and lower than the ``--quantizer rtn`` run at the same budget."""
    import mixbits
    from mixbits.measure.candidates import CONVERT_MENUS, expand_candidates, with_quantizer

    tokens = np.load(dense / "tokens.npy")
    model, _, _ = mixbits.load(dense / "model")
    ref = _log_softmax(np.array(model(mx.array(tokens)).astype(mx.float32), dtype=np.float64))
    kls = {}
    for q in (None, "rtn"):
        out = tmp_path / f"q_{q}"
        argv = ["convert", "--model", str(dense / "model"), "--tokens", str(dense / "tokens.npy"), "--bpw", "3.6",
                "--out", str(out), "--max-evals", "3", "--method", "grad"] + (["--quantizer", q] if q else [])
        assert main(argv) == 0, capsys.readouterr().err
        settings = json.loads((Path(str(out) + ".work") / "settings.json").read_text())
        alloc = json.loads((out / "allocation.json").read_text())
        want = "search" if q is None else q
        assert settings["candidates"] == expand_candidates(with_quantizer(CONVERT_MENUS["extended"], want))
        kinds = {a["kind"] for a in alloc["assignment"]}
        assert all(k.endswith("+search") for k in kinds) if want == "search" else not any("+" in k for k in kinds)
        saved, _, _ = mixbits.load(out)
        got = _log_softmax(np.array(saved(mx.array(tokens)).astype(mx.float32), dtype=np.float64))
        kls[want] = float((np.exp(ref) * (ref - got)).sum(axis=-1).mean())
        assert alloc["menu"]["calibration_joint_kl"][alloc["menu"]["kept"]] == pytest.approx(kls[want], rel=2e-3)
    assert kls["search"] < 0.9 * kls["rtn"], kls
