"""The baseline guard: an allocation that scores worse than uniform
quantization (or mlx-lm's mixed recipe) on the calibration evaluation is
never written silently. The planted case is a sensitivity table whose KLs
are inverted (the narrowest width looks harmless), as a table measured on
far too few tokens can be: the knapsack then takes 2 bits everywhere,
which the real joint KL shows to be much worse than uniform 3-bit."""

import copy
import warnings

import numpy as np
import pytest

from mixbits.errors import CalibrationWarning
from mixbits.measure.baselines import baselines, entry_bpw, mixed_rule
from mixbits.measure.joint import JointEvaluator
from mixbits.measure.refine import refine
from mixbits.measure.sweep import sweep
from tiny_model import tiny_llama, tiny_tokens

CANDS = ["2b_g64", "3b_g64", "4b_g64", "6b_g64", "8b_g64"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_llama(layers=4)
    toks = tiny_tokens(n=3)
    table = sweep(model, toks, tmp_path_factory.mktemp("g") / "t.json", CANDS, progress=False)
    return model, toks, table


def inverted(table):
    """Each tensor's KLs in reverse order of width: 2 bits looks best."""
    bad = copy.deepcopy(table)
    for e in bad["entries"]:
        kls = sorted(c["kl"] for c in e["candidates"])
        for c, kl in zip(sorted(e["candidates"], key=lambda c: c["bits"]), kls):
            c["kl"] = kl
    return bad


def test_a_planted_loss_to_uniform_writes_uniform_and_warns(setup):
    model, toks, table = setup
    ev = JointEvaluator(model, toks, chunk=3)
    bad = inverted(table)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = refine(bad, ev, high_avg=3.5, max_evals=4, progress=False)
    kinds = {a["kind"] for a in out["assignment"]}
    assert kinds == {"3b_g64"}, kinds
    assert out["guard"]["written"] == "uniform 3b_g64"
    msgs = [str(w.message) for w in seen if issubclass(w.category, CalibrationWarning)]
    assert len(msgs) == 1 and "--n-seq" in msgs[0] and "uniform 3b_g64" in msgs[0]
    # the recorded scores are the real joint KLs of what they name
    uni = next(b for b in out["baselines"] if b["name"] == "uniform 3b_g64")
    assert uni["joint_kl"] == pytest.approx(ev.joint_kl({e["path"]: "3b_g64" for e in table["entries"]})[0])
    assert out["guard"]["mixed_joint_kl"] > uni["joint_kl"] == out["guard"]["joint_kl"]
    assert out["average_bpw_storage"] == pytest.approx(3.5)
    # without the guard the planted table's allocation is what gets written
    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationWarning)
        raw = refine(bad, ev, high_avg=3.5, max_evals=4, progress=False, check_baselines=False)
    assert {a["kind"] for a in raw["assignment"]} != {"3b_g64"}
    assert "guard" not in raw


def test_an_allocation_that_wins_is_kept_with_the_baselines_recorded(setup):
    model, toks, table = setup
    ev = JointEvaluator(model, toks, chunk=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationWarning)
        out = refine(table, ev, high_avg=3.9, max_evals=4, progress=False)
    names = [b["name"] for b in out["baselines"]]
    assert names[0] == "uniform 3b_g64" and names[1].startswith("mlx-lm mixed recipe")
    assert out["guard"]["written"] == "mixed allocation"
    assert all(b["joint_kl"] >= out["guard"]["joint_kl"] for b in out["baselines"])
    assert all(b["bpw"] <= 3.9 for b in out["baselines"])


def test_baselines_are_the_widest_within_the_budget(setup):
    model, toks, table = setup
    ev = JointEvaluator(model, toks, chunk=3)
    got = baselines(table, ev.adapter, 4.6)
    uni = [(n, b) for n, _, b in got if n.startswith("uniform")]
    assert uni == [("uniform 4b_g64", pytest.approx(4.5))]
    (name, plan, bpw), = [g for g in got if g[0].startswith("mlx-lm")]
    # the widest of the recipes (every pair of widths) that fit under 4.6
    recipes = [("2b_g64", "6b_g64"), ("3b_g64", "4b_g64"), ("3b_g64", "6b_g64"), ("4b_g64", "6b_g64")]
    pairs = {(lo, hi): entry_bpw(table, mixed_rule(table, lo, hi, ev.adapter)) for lo, hi in recipes}
    (lo, hi), widest = max(((k, v) for k, v in pairs.items() if v <= 4.6), key=lambda kv: kv[1])
    assert name == f"mlx-lm mixed recipe {lo}/{hi}" and bpw == pytest.approx(widest) and bpw <= 4.6
    assert plan == mixed_rule(table, lo, hi, ev.adapter)
    assert entry_bpw(table, plan) == pytest.approx(bpw)
    # a head (tied embedding used as a head) and some value projections go wide
    assert {k for k, v in plan.items() if v == hi}
    assert baselines(table, ev.adapter, 2.0) == []
    # under a floor, the uniform 2-bit that fits the ceiling is not offered
    assert all(b >= 2.9 for _, _, b in baselines(table, ev.adapter, 3.5, low_avg=2.9))
    assert np.isfinite([b for _, _, b in got]).all()
