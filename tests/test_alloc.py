"""The exact allocator against independent solvers: brute force on small
random instances, scipy's MILP (HiGHS) and LP on medium ones and on the
shared ExLlamaV2 measurement; the CLI end to end."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from mixbits.alloc import InfeasibleBudget, MCKProblem, lagrangian_value, lower_hull, solve, solve_lp
from mixbits.formats import Allocation, Measurement, SensitivityTable, projection_shapes

scipy_optimize = pytest.importorskip("scipy.optimize")
from scipy.sparse import csr_matrix  # noqa: E402

from shared_files import ALLOC, DATA, HF_CONFIG, MEAS  # noqa: E402,F401


# ------------------------------------------------------------ references


def brute_force(p: MCKProblem, budget, lower=None):
    best = None
    for ch in itertools.product(*[range(len(w)) for w in p.weights]):
        bits = sum(int(p.weights[i][j]) for i, j in enumerate(ch))
        if bits > budget or (lower is not None and bits < lower):
            continue
        cost = math.fsum(float(p.costs[i][j]) for i, j in enumerate(ch))
        if best is None or cost < best:
            best = cost
    return best


def _mckp_matrices(p: MCKProblem):
    sizes = [len(w) for w in p.weights]
    n = sum(sizes)
    rows = np.repeat(np.arange(p.n_slots), sizes)
    one_each = csr_matrix((np.ones(n), (rows, np.arange(n))), shape=(p.n_slots, n))
    return np.concatenate(p.costs), np.concatenate(p.weights).astype(np.float64), one_each


def milp(p: MCKProblem, budget, lower=None, cost_scale=1.0):
    """Binary x_ij, one per slot, bits within [lower, budget]: HiGHS via scipy.
    Returns (cost of the rounded solution, its bits, MILP dual bound)."""
    c, w, one_each = _mckp_matrices(p)
    cons = [scipy_optimize.LinearConstraint(one_each, 1, 1),
            scipy_optimize.LinearConstraint(w[None, :], -np.inf if lower is None else lower, budget)]
    r = scipy_optimize.milp(c * cost_scale, constraints=cons, integrality=np.ones(len(c)),
                            bounds=scipy_optimize.Bounds(0, 1), options={"mip_rel_gap": 0})
    assert r.success, r.message
    x = np.round(r.x).astype(int)
    sizes = np.cumsum([0] + [len(wi) for wi in p.weights])
    choice = [int(np.argmax(x[sizes[i]:sizes[i + 1]])) for i in range(p.n_slots)]
    cost, bits = p.evaluate(choice)
    return cost, bits, r.mip_dual_bound / cost_scale


def lp(p: MCKProblem, budget, lower=None):
    c, w, one_each = _mckp_matrices(p)
    a_ub = np.vstack([w, -w]) if lower is not None else w[None, :]
    b_ub = [budget, -lower] if lower is not None else [budget]
    r = scipy_optimize.linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=one_each.toarray(), b_eq=np.ones(p.n_slots),
                               bounds=(0, 1), method="highs")
    assert r.success, r.message
    return r.fun


def random_problem(rng, n, m_max, wmax=30, integer_costs=False):
    ws, cs = [], []
    for _ in range(n):
        m = int(rng.integers(1, m_max + 1))
        ws.append(rng.integers(0, wmax, m))
        cs.append(rng.integers(0, 1000, m).astype(float) if integer_costs else rng.normal(size=m))
    return MCKProblem(ws, cs)


def _check_solution(p, s, budget, lower=None):
    cost, bits = p.evaluate(s.choice)
    assert bits == s.bits and cost == pytest.approx(s.cost, abs=1e-12)
    assert bits <= budget and (lower is None or bits >= lower)
    assert s.lower_bound <= s.cost + 1e-9 * (1 + abs(s.cost))
    assert s.gap == pytest.approx(s.cost - s.lower_bound)


# ------------------------------------------------------------ small: brute force


def test_matches_brute_force_on_small_random_instances():
    rng = np.random.default_rng(1)
    checked = with_lower = 0
    for _ in range(400):
        p = random_problem(rng, int(rng.integers(1, 6)), 5)
        budget = int(rng.integers(p.min_bits, p.max_bits + 3))
        lower = None
        if rng.random() < 0.4:
            lower = int(rng.integers(max(0, p.min_bits - 3), budget + 1))
        ref = brute_force(p, budget, lower)
        if ref is None:  # a lower bound no choice can meet between the two bounds
            continue
        s = solve(p, budget, lower)
        _check_solution(p, s, budget, lower)
        assert s.cost == pytest.approx(ref, abs=1e-12)
        checked += 1
        with_lower += lower is not None
    assert checked > 300 and with_lower > 100


def test_ties_duplicates_and_zero_bit_options():
    p = MCKProblem([[0, 5, 5, 10], [3, 3], [0]], [[1.0, 0.5, 0.5, 0.2], [2.0, 2.0], [0.0]])
    for budget in range(3, 17):
        assert solve(p, budget).cost == pytest.approx(brute_force(p, budget))
    # cheaper options with *more* bits: the lower bound forces the costly side
    p = MCKProblem([[1, 2, 3], [1, 2, 3]], [[0.0, 1.0, 5.0], [0.0, 2.0, 3.0]])
    s = solve(p, 6, lower=5)
    assert s.bits >= 5 and s.cost == pytest.approx(brute_force(p, 6, 5)) == 4.0


# ------------------------------------------------------------ medium: MILP and LP


@pytest.mark.parametrize("seed", range(6))
def test_matches_milp_on_medium_instances(seed):
    rng = np.random.default_rng(100 + seed)
    p = random_problem(rng, 40, 8, wmax=1000, integer_costs=True)
    for frac in (0.2, 0.5, 0.8):
        budget = int(p.min_bits + frac * (p.max_bits - p.min_bits))
        lower = budget - 500 if seed % 2 else None
        s = solve(p, budget, lower)
        _check_solution(p, s, budget, lower)
        ref_cost, ref_bits, _ = milp(p, budget, lower)
        assert ref_bits <= budget and (lower is None or ref_bits >= lower)
        assert s.cost == ref_cost  # integer costs: both exact


@pytest.mark.parametrize("seed", range(4))
def test_lp_relaxation_and_lagrangian_bound(seed):
    rng = np.random.default_rng(200 + seed)
    p = random_problem(rng, 30, 8, wmax=1000)
    for frac in (0.3, 0.7):
        budget = int(p.min_bits + frac * (p.max_bits - p.min_bits))
        lower = budget - 2000 if seed % 2 else None
        relax = solve_lp(p.weights, p.costs, budget, lower)
        assert relax.lp_value == pytest.approx(lp(p, budget, lower), rel=1e-9, abs=1e-9)
        s = solve(p, budget, lower)
        assert s.lower_bound == pytest.approx(relax.lp_value, rel=1e-9, abs=1e-9)  # LP duality
        # weak duality: every multiplier bounds the optimum from below
        m = max(len(w) for w in p.weights)
        Wp = np.zeros((p.n_slots, m), dtype=np.int64)
        Cp = np.full((p.n_slots, m), np.inf)
        for i, (w, c) in enumerate(zip(p.weights, p.costs)):
            Wp[i, :len(w)], Cp[i, :len(c)] = w, c
        for nu in np.concatenate([[0.0], rng.exponential(0.01, 10), -rng.exponential(0.01, 3)]):
            assert lagrangian_value(Wp, Cp, float(nu), budget, lower) <= s.cost + 1e-9


def test_lower_hull():
    w = np.array([0, 1, 2, 3, 4, 2])
    c = np.array([4.0, 2.0, 1.5, 0.0, 0.0, 1.0])
    # (2, 1.5) loses to (2, 1.0); (2, 1.0) lies on the chord (1,2)-(3,0); (4, 0) is flat after (3, 0)
    assert lower_hull(w, c) == [0, 1, 3, 4]


# ------------------------------------------------------------ errors


def test_budget_below_cheapest_choice_is_a_clear_error():
    p = MCKProblem([[10, 20], [5, 7]], [[1.0, 0.5], [1.0, 0.2]], nparams=[4, 2])
    with pytest.raises(InfeasibleBudget, match=r"budget of 14 bits is below the cheapest choice: .* needs 15 bits \(2.5000 bpw\)"):
        solve(p, 14)
    with pytest.raises(InfeasibleBudget, match="lower bound of 28 bits is above the largest choice"):
        solve(p, 30, lower=28)
    with pytest.raises(ValueError, match="lower bound 20 bits exceeds the budget 19"):
        solve(p, 19, lower=20)
    with pytest.raises(TypeError, match="budget must be an integer"):
        solve(p, 20.5)
    with pytest.raises(ValueError, match="budget must be >= 0"):
        solve(p, -1)
    assert isinstance(InfeasibleBudget("x"), ValueError)


def test_problem_validation():
    with pytest.raises(ValueError, match="slot 1: bit counts must be >= 0"):
        MCKProblem([[1], [-2]], [[0.0], [0.0]])
    with pytest.raises(ValueError, match="slot 0: bit counts must be integers"):
        MCKProblem([[1.5]], [[0.0]])
    with pytest.raises(ValueError, match="slot 0: costs must be finite"):
        MCKProblem([[1, 2]], [[0.0, float("nan")]])
    with pytest.raises(ValueError, match="slot 0: weights and costs must be equal-length"):
        MCKProblem([[1, 2]], [[0.0]])
    with pytest.raises(ValueError, match="needs at least one slot"):
        MCKProblem([], [])
    with pytest.raises(ValueError, match="needs the tensor shapes"):
        MCKProblem([[1]], [[0.0]]).budget_from_bpw(4.0)


# ------------------------------------------------------------ the shared measurement


@pytest.fixture(scope="module")
def measurement():
    return Measurement.load(MEAS)


@pytest.mark.parametrize("power", [1.0, 2.0, 3.0])
def test_measurement_allocations_are_optimal(measurement, power):
    p = MCKProblem.from_measurement(measurement, power, projection_shapes(HF_CONFIG))
    assert p.n_slots == 96 and p.total_params == 48 * (2 * 4096 * 4096 + 2 * 4096 * 512 + 3 * 4096 * 11008)
    # costs scaled for HiGHS, whose absolute gap tolerance (1e-6) is coarse next to (1-acc)^3 ~ 1e-6
    scale = 1.0 / max(float(c.max()) for c in p.costs) * 1e4
    prev = math.inf
    for bpw in (2.6, 3.0, 4.0, 5.0, 6.5):
        budget = p.budget_from_bpw(bpw)
        s = solve(p, budget)
        _check_solution(p, s, budget)
        assert s.bpw == pytest.approx(s.bits / p.total_params) and s.bpw <= bpw
        ref_cost, ref_bits, dual = milp(p, budget, cost_scale=scale)
        assert ref_bits <= budget
        assert s.cost <= ref_cost * (1 + 1e-12)  # never worse than HiGHS' best
        assert s.cost >= dual * (1 - 1e-9)        # and not below its proven bound
        assert s.cost <= prev  # more budget never hurts
        prev = s.cost


def test_measurement_lower_bound_and_tiny_budget(measurement):
    p = MCKProblem.from_measurement(measurement, 2.0, projection_shapes(HF_CONFIG))
    budget, lower = p.budget_from_bpw(4.0), p.budget_from_bpw(3.99)
    s = solve(p, budget, lower)
    _check_solution(p, s, budget, lower)
    scale = 1.0 / max(float(c.max()) for c in p.costs) * 1e4
    ref_cost, _, dual = milp(p, budget, lower, cost_scale=scale)
    assert dual * (1 - 1e-9) <= s.cost <= ref_cost * (1 + 1e-12)
    with pytest.raises(InfeasibleBudget, match="below the cheapest choice"):
        solve(p, p.min_bits - 1)
    assert solve(p, p.min_bits).bits == p.min_bits


def test_allocation_like_table_with_its_budget_window():
    """A sensitivity table over allocation.json's tensors, allocated inside
    the file's own [low_avg, high_avg] window, checked against MILP."""
    raw = json.loads(ALLOC.read_text())
    rng = np.random.default_rng(7)
    entries = []
    for e in raw["assignment"]:
        base = e["kl"] * rng.uniform(0.5, 2.0)
        cands = [{"kind": "4", "bits": 4, "kl": base},
                 {"kind": "3", "bits": 3, "kl": base * rng.uniform(2, 5)},
                 {"kind": "2", "bits": 2, "kl": base * rng.uniform(8, 30)},
                 {"kind": "ternary", "bits": 2, "kl": base * rng.uniform(5, 40)}]
        entries.append({"path": e["path"], "layer": e["layer"], "nparams": e["nparams"], "candidates": cands})
    table = SensitivityTable.from_dict({"format": "mixbits.sensitivity", "version": 1, "entries": entries})
    p = MCKProblem.from_table(table, "nominal")  # the shared file's budget counts nominal bits
    lo, hi = raw["budget"]["low_avg"], raw["budget"]["high_avg"]
    budget, lower = math.floor(hi * p.total_params), math.ceil(lo * p.total_params)
    s = solve(p, budget, lower)
    _check_solution(p, s, budget, lower)
    ref_cost, _, dual = milp(p, budget, lower, cost_scale=1e3)
    assert dual * (1 - 1e-9) - 1e-12 <= s.cost <= ref_cost * (1 + 1e-12)
    alloc = table.to_allocation(s.choice, low_avg=lo, high_avg=hi, count="nominal")
    assert lo <= alloc.average_bits <= hi
    assert alloc.sum_kl == pytest.approx(s.cost) and alloc.dp_sum_kl == pytest.approx(s.cost)
    Allocation.from_dict(alloc.to_dict())  # passes its own checks


# ------------------------------------------------------------ CLI


def _cli(argv):
    from mixbits.cli import main

    return main(argv)


def test_cli_measurement_strategy(tmp_path, capsys, measurement):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(HF_CONFIG))
    out = tmp_path / "strategy.json"
    assert _cli(["allocate", str(MEAS), "--bpw", "3.5", "--config", str(cfg), "--power", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "layer" in printed and "Lagrangian lower bound" in printed and "self_attn" in printed
    strategy = json.loads(out.read_text())
    measured = measurement.measured()
    assert list(strategy) == list(measured)
    raw = json.loads(MEAS.read_text())["measurement"]
    total = 0
    for key, opt in strategy.items():
        assert opt in raw[key]  # the option dict exactly as in the measurement
        total += opt["total_bits"]
    p = MCKProblem.from_measurement(measurement, 2.0, projection_shapes(HF_CONFIG))
    assert total <= p.budget_from_bpw(3.5)
    assert total == solve(p, p.budget_from_bpw(3.5)).bits
    # a bits budget gives the same answer without shapes
    out2 = tmp_path / "strategy2.json"
    assert _cli(["allocate", str(MEAS), "--budget-bits", str(p.budget_from_bpw(3.5)), "--out", str(out2),
                 "--quiet"]) == 0
    assert json.loads(out2.read_text()) == strategy


def test_cli_errors(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert _cli(["allocate", str(MEAS), "--budget-bits", "1000", "--out", str(out)]) == 2
    assert "below the cheapest choice" in capsys.readouterr().err
    assert _cli(["allocate", str(MEAS), "--bpw", "4", "--out", str(out)]) == 2
    assert "pass --config" in capsys.readouterr().err
    trunc = tmp_path / "m.json"
    trunc.write_bytes(MEAS.read_bytes()[:777])
    assert _cli(["allocate", str(trunc), "--budget-bits", "10", "--out", str(out)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert _cli(["allocate", str(ALLOC), "--budget-bits", "10", "--out", str(out)]) == 2
    assert "neither an ExLlamaV2 measurement" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(SystemExit):
        _cli(["allocate", str(MEAS), "--out", str(out)])  # a budget is required


def test_cli_sensitivity_table_writes_allocation(tmp_path, capsys):
    raw = json.loads(ALLOC.read_text())
    entries = [{"path": e["path"], "layer": e["layer"], "nparams": e["nparams"],
                "candidates": [{"kind": str(b), "bits": b, "kl": e["kl"] * 3.0 ** (4 - b)} for b in (2, 3, 4)]}
               for e in raw["assignment"]]
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"format": "mixbits.sensitivity", "version": 1, "embed_bits": 8, "entries": entries}))
    out = tmp_path / "allocation.json"
    assert _cli(["allocate", str(table), "--bpw", "3.5", "--min-bpw", "3.4", "--count", "nominal",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "avg bits" in printed and "kinds" in printed
    a = Allocation.load(out)  # checks average_bits, sum_kl and the budget window
    assert 3.4 <= a.average_bits <= 3.5 and a.embed_bits == 8 and len(a.assignment) == len(entries)
    p = MCKProblem.from_table(SensitivityTable.load(table), "nominal")
    assert a.sum_kl == pytest.approx(solve(p, p.budget_from_bpw(3.5), math.ceil(3.4 * p.total_params)).cost)
    bad = json.loads(table.read_text())
    bad["complete"] = False
    table.write_text(json.dumps(bad))
    assert _cli(["allocate", str(table), "--bpw", "3.5", "--count", "nominal",
                 "--out", str(tmp_path / "b.json")]) == 2
    assert "has not finished" in capsys.readouterr().err


def test_cli_storage_budget_on_sweep_like_table(tmp_path, capsys):
    from test_formats import _sweep_like_table

    raw = _sweep_like_table()
    table = tmp_path / "table.json"
    table.write_text(json.dumps(raw))
    out = tmp_path / "allocation.json"
    # storage budget: 18432 + 14746 bits fits 4b_g64 in one tensor and the mixed candidate in the other
    assert _cli(["allocate", str(table), "--budget-bits", str(18432 + 14746), "--count", "storage",
                 "--out", str(out), "--quiet"]) == 0
    a = Allocation.load(out)
    kinds = [e.kind for e in a.assignment]
    costs = {(i, c["kind"]): (c["storage_bits"], c["kl"]) for i, e in enumerate(raw["entries"]) for c in e["candidates"]}
    best = min((costs[(0, k0)][1] + costs[(1, k1)][1], k0, k1)
               for k0 in ("4b_g64", "4b10_3b_g64", "8b50_6b_g64", "ternary_g64")
               for k1 in ("4b_g64", "4b10_3b_g64", "8b50_6b_g64", "ternary_g64")
               if costs[(0, k0)][0] + costs[(1, k1)][0] <= 18432 + 14746)
    assert kinds == [best[1], best[2]] and a.sum_kl == pytest.approx(best[0])
    assert a.budget["count"] == "storage"
    del raw["entries"][1]["candidates"][0]["storage_bits"]
    table.write_text(json.dumps(raw))
    assert _cli(["allocate", str(table), "--budget-bits", "40000", "--count", "storage", "--out", str(out)]) == 2
    assert "no storage_bits" in capsys.readouterr().err
