"""Evolutionary allocation search against a measured (non-additive) joint KL."""

import numpy as np
import pytest

from mixbits.alloc import MCKProblem, solve
from mixbits.measure.evolve import evolve, mutate


def _problem(n=24, seed=0):
    rng = np.random.default_rng(seed)
    weights = [[2 * 100, 3 * 100, 4 * 100] for _ in range(n)]
    costs = []
    for _ in range(n):
        base = rng.uniform(0.01, 0.1)
        costs.append([base * 8, base * 3, base])
    return weights, costs


def test_mutations_stay_in_the_budget_window_and_are_seeded():
    weights, _ = _problem()
    start = [1] * len(weights)  # all 3-bit: 7200 bits
    rng = np.random.default_rng(3)
    kids = [mutate(weights, start, 7200, 7000, rng) for _ in range(50)]
    for k in kids:
        assert k is not None and k != start
        assert 7000 <= sum(weights[i][j] for i, j in enumerate(k)) <= 7200
    again = [mutate(weights, start, 7200, 7000, np.random.default_rng(3)) for _ in range(1)]
    assert again[0] == kids[0]


def test_evolve_beats_the_additive_optimum_when_damage_interacts():
    weights, costs = _problem()
    n = len(weights)
    # Planted interaction: tensors 0..5 hurt 10x more when two or more of
    # them sit at 2 bits -- invisible to the summed per-tensor KL.
    def joint(ch, chunks=4):
        s = sum(costs[i][j] for i, j in enumerate(ch))
        low = sum(1 for i in range(6) if ch[i] == 0)
        noise = 0.002 * (4 - chunks)  # smaller prefixes are noisier estimates
        return s + (0.5 * low if low >= 2 else 0.0) + noise

    prob = MCKProblem(weights, costs)
    sol = solve(prob, 3 * 100 * n)
    start = [int(j) for j in sol.choice]
    s0 = joint(start)
    best, score, cost, gens, wins = evolve(joint, weights, start, s0, 3 * 100 * n, None,
                                           n_chunks=4, eval_budget=120, seed=1)
    assert cost <= 120 and gens > 0
    assert sum(weights[i][j] for i, j in enumerate(best)) <= 3 * 100 * n
    assert score == pytest.approx(joint(best))
    assert score < s0 and wins >= 1
    # same seed, same result
    assert evolve(joint, weights, start, s0, 3 * 100 * n, None, n_chunks=4, eval_budget=120,
                  seed=1)[0] == best


def test_refine_evolve_on_a_model(tmp_path):
    import tiny_models
    from mixbits.measure.joint import JointEvaluator
    from mixbits.measure.refine import refine
    from mixbits.measure.sweep import sweep

    model, _ = tiny_models.build("llama")
    toks = np.random.default_rng(0).integers(0, 160, (4, 16))
    table = sweep(model, toks, tmp_path / "t.json", ["2b_g64", "3b_g64", "4b_g64"], progress=False)
    ev = JointEvaluator(model, toks, chunk=1)
    out = refine(table, ev, 3.9, max_evals=12, progress=False, method="evolve", seed=0,
                 check_baselines=False)
    jr = out["joint_refine"]
    assert jr["method"] == "evolve" and jr["evaluations"] <= 12
    assert jr["joint_kl_after"] <= jr["joint_kl_before"]
    got = {a["path"]: a["kind"] for a in out["assignment"]}
    assert jr["joint_kl_after"] == pytest.approx(ev.joint_kl(got)[0])
    assert out["average_bpw_storage"] <= 3.9 + 1e-12
    with pytest.raises(ValueError, match="method"):
        refine(table, ev, 3.9, method="anneal")
