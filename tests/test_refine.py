"""Allocation from a sweep table, and joint-KL refinement on a tiny model."""

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from mixbits.measure.joint import JointEvaluator  # noqa: E402
from mixbits.measure.refine import allocate_table, refine  # noqa: E402
from mixbits.measure.sweep import sweep  # noqa: E402
from tiny_model import tiny_llama, tiny_tokens  # noqa: E402

CANDS = ["2b_g64", "3b_g64", "4b_g64", "8b_g64"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_llama(layers=2)
    toks = tiny_tokens(n=3)
    table = sweep(model, toks, tmp_path_factory.mktemp("s") / "t.json", CANDS, progress=False)
    return model, toks, table


def test_allocation_meets_budget_and_is_optimal_by_brute_force_on_subsets(setup):
    _, _, table = setup
    alloc, sol, prob = allocate_table(table, high_avg=3.6)
    total = sum(e["nparams"] for e in table["entries"])
    storage = sum(a["storage_bits"] for a in alloc["assignment"])
    assert storage <= 3.6 * total
    assert alloc["average_bpw_storage"] == pytest.approx(storage / total)
    assert alloc["sum_kl"] == pytest.approx(sum(a["kl"] for a in alloc["assignment"]))
    # greedy check of optimality: no single-tensor change that fits the
    # budget lowers the summed KL
    choice = list(sol.choice)
    for i in range(prob.n_slots):
        for k in range(len(prob.weights[i])):
            bits = sol.bits - prob.weights[i][choice[i]] + prob.weights[i][k]
            if bits <= sol.budget:
                assert prob.costs[i][k] >= prob.costs[i][choice[i]] - 1e-12


def test_refine_never_worse_than_dp_and_reports(setup):
    model, toks, table = setup
    ev = JointEvaluator(model, toks, chunk=2)
    out = refine(table, ev, high_avg=3.6, max_evals=6, progress=False, check_baselines=False)
    jr = out["joint_refine"]
    assert jr["joint_kl_after"] <= jr["joint_kl_before"]
    assert jr["joint_kl_after"] <= min(st["joint_kl"] for st in jr["starts"])
    assert [st["power"] for st in jr["starts"]] == [1.0, 1.5, 2.0]
    assert len(jr["log"]) + 1 <= jr["evaluations"] <= 6
    assert jr["swaps"] == sum(s["kept"] for s in jr["log"])
    # the reported joint KL of the final assignment is reproducible
    final = {a["path"]: a["kind"] for a in out["assignment"]}
    assert ev.joint_kl(final)[0] == pytest.approx(jr["joint_kl_after"], rel=1e-6)
    total = sum(a["nparams"] for a in out["assignment"])
    assert sum(a["storage_bits"] for a in out["assignment"]) <= 3.6 * total
    assert list(out)[:7] == ["average_bits", "embed_bits", "budget", "sum_kl", "dp_sum_kl",
                             "joint_refine", "assignment"]


def test_joint_kl_of_empty_assignment_is_zero_and_grows_with_damage(setup):
    model, toks, _ = setup
    ev = JointEvaluator(model, toks, chunk=2)
    assert ev.joint_kl({})[0] == pytest.approx(0.0, abs=1e-6)
    paths = list(ev.sites)
    one = ev.joint_kl({paths[0]: "2b_g64"})[0]
    allp = ev.joint_kl({p: "2b_g64" for p in paths})[0]
    assert 0 < one < allp
    with pytest.raises(ValueError, match="unknown tensors"):
        ev.joint_kl({"model.layers.9.mlp.up_proj": "2b_g64"})


def test_sequence_kls_are_each_sequence_scored_alone(setup):
    """Per-sequence joint KLs (3 sequences in chunks of 2 and 1) equal each
    sequence's joint KL on an evaluator of that sequence alone, in order,
    and their mean is the joint KL."""
    model, toks, _ = setup
    ev = JointEvaluator(model, toks, chunk=2)
    a = {p: "2b_g64" for p in list(ev.sites)[:4]}
    per = ev.sequence_kls(a)
    alone = [JointEvaluator(model, toks[i:i + 1], chunk=1).joint_kl(a)[0] for i in range(len(toks))]
    assert per.shape == (len(toks),) and len(set(np.round(alone, 6))) == len(toks)
    np.testing.assert_allclose(per, alone, rtol=1e-4)
    assert per.mean() == pytest.approx(ev.joint_kl(a)[0], rel=1e-9)


def test_compare_strategies_table(setup):
    from mixbits.measure.compare import compare, entry_bpw, format_rows, mixed_rule, nearest_uniform

    model, toks, table = setup
    ev = JointEvaluator(model, toks, chunk=2)
    # 3-bit g64 with fp16 scale+bias stores 3.5 bits per weight
    assert nearest_uniform(table, 3.4) == ("3b_g64", pytest.approx(3.5))
    rule = mixed_rule(table, "3b_g64", "4b_g64", ev.adapter)
    big = tiny_llama(layers=16)
    from mixbits.adapter import ModelAdapter

    fake = {"entries": [{"path": s.path} for s in ModelAdapter(big).sites]}
    hi = mixed_rule(fake, "lo", "hi", ModelAdapter(big))
    assert hi["model.embed_tokens"] == "lo"  # the tied embedding is not an lm_head
    hi = {p: v for p, v in hi.items() if "layers" in p}
    # 16 layers: first and last eighth (0, 1, 14, 15) and every third between (4, 7, 10, 13)
    assert sorted({int(p.split(".")[2]) for p, v in hi.items() if v == "hi"}) == [0, 1, 4, 7, 10, 13, 14, 15]
    assert not any(v == "hi" for p, v in hi.items() if p.endswith("q_proj"))
    held = JointEvaluator(model, tiny_tokens(n=2, seed=7), chunk=2)
    rows = compare(table, ev, [3.5], max_evals=3, holdout=held)
    assert len(rows) == 2
    for r in rows:
        assert r["dp"]["bpw"] <= r["target_bpw"] + 1e-9
        assert r["refined"]["joint_kl"] <= r["dp"]["joint_kl"] + 1e-9
        assert r["dp"]["joint_kl"] == pytest.approx(
            ev.joint_kl({a: c for a, c in _dp_assignment(table, r["target_bpw"]).items()})[0])
        for key in ("baseline", "dp", "refined"):
            assert r[key]["holdout_joint_kl"] > 0
    assert rows[0]["baseline"]["holdout_joint_kl"] == pytest.approx(
        held.joint_kl({e["path"]: "3b_g64" for e in table["entries"]})[0])
    assert "held-out tokens" in format_rows(rows)
    assert rows[1]["target_bpw"] == pytest.approx(entry_bpw(table, rule))
    assert "| 3.500 | uniform 3b_g64 |" in format_rows(rows)


def _dp_assignment(table, bpw):
    alloc, _, _ = allocate_table(table, high_avg=bpw)
    return {a["path"]: a["kind"] for a in alloc["assignment"]}


class SquaredKL:
    """A stand-in for the joint evaluator whose "joint KL" is the sum of
    squared per-tensor KLs: strongly non-additive in the way real joint KL
    is (one large error costs more than several small ones)."""

    def __init__(self, table):
        self.kl = {(e["path"], c["kind"]): c["kl"] for e in table["entries"] for c in e["candidates"]}
        self.tokens = [0]
        self.calls = 0

    def joint_kl(self, assignment):
        self.calls += 1
        return sum(self.kl[(p, k)] ** 2 for p, k in assignment.items()), 0.0


def test_refine_starts_from_the_power_that_fits_the_measured_objective(setup):
    _, _, table = setup
    ev = SquaredKL(table)
    out = refine(table, ev, high_avg=3.6, max_evals=3, progress=False, powers=(2.0,),
                 check_baselines=False)
    jr = out["joint_refine"]
    p1, p2 = jr["starts"]
    assert (p1["power"], p2["power"]) == (1.0, 2.0)
    # The knapsack on KL**2 minimizes this objective exactly under the same
    # budget, so no start (and no swap) can beat it.
    assert p2["joint_kl"] <= p1["joint_kl"]
    assert jr["joint_kl_after"] == pytest.approx(p2["joint_kl"], rel=1e-12)
    final = {a["path"]: a["kind"] for a in out["assignment"]}
    assert ev.joint_kl(final)[0] == pytest.approx(jr["joint_kl_after"])
    assert jr["evaluations"] == ev.calls - 1 <= 3


def test_held_out_evaluator_fits_calibrated_candidates_on_calibration_tokens(setup):
    """A held-out evaluator built with ``calibration=`` takes X^T X from the
    calibration tokens (a +gptq layer fitted on the tokens that score it
    would flatter it); without it, from its own tokens."""
    model, toks, _ = setup
    cal = JointEvaluator(model, toks, chunk=2)
    held_toks = tiny_tokens(n=2, seed=7)
    held = JointEvaluator(model, held_toks, chunk=2, calibration=cal)
    alone = JointEvaluator(model, held_toks, chunk=2)
    path = next(p for p in cal.sites if p.endswith("mlp.down_proj"))
    h_cal, n_cal = cal.hessian(path)
    h_held, n_held = held.hessian(path)
    h_alone, n_alone = alone.hessian(path)
    assert n_held == n_cal == toks.size and n_alone == held_toks.size
    np.testing.assert_array_equal(np.asarray(h_held), np.asarray(h_cal))
    assert not np.allclose(np.asarray(h_alone), np.asarray(h_cal))
    layer = held.layer(path, "3b_g64+gptq")
    assert cal.layer(path, "3b_g64+gptq") is layer  # one cache, one fit
    assert alone.layer(path, "3b_g64+gptq") is not layer
