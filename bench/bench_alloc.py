"""Exact bit allocation under pytest-benchmark, with its baseline in the same
run: scipy's MILP (HiGHS branch and cut) on the very same instance.

Instances:
- ``random 1000x20``: 1,000 tensors (shapes of a 7B-class model: 4096x4096,
  4096x512, 4096x11008) x 20 candidates each at bits per weight drawn from
  [2, 8.5], cost decreasing with bits (exp(-1.3 bpw), per-tensor scale,
  5% noise, so hulls are not clean); budgets in bits ~ 1e10;
- ``exl2 measurement``: the shared ExLlamaV2 measurement.json (96 modules
  x 17-19 options), cost (1 - accuracy)^2, if ../shared/data is present.

    python -m pytest bench/bench_alloc.py            # quick: one budget each
    python -m pytest bench/bench_alloc.py --bench-full

Each row also checks that both solvers agree on the optimum (HiGHS stops
within its 1e-6 absolute gap, so its cost may be slightly higher, never
lower). The table is printed at the end and saved as bench/results/alloc.json.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_matrix

from mixbits.alloc import MCKProblem, solve

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
HF_CONFIG = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 4,
             "head_dim": 128, "intermediate_size": 11008}


def random_instance(n: int, m: int, seed: int) -> MCKProblem:
    rng = np.random.default_rng(seed)
    nparams = rng.choice([4096 * 4096, 4096 * 512, 4096 * 11008], n)
    ws, cs = [], []
    for i in range(n):
        bpw = np.sort(rng.uniform(2.0, 8.5, m))
        ws.append(np.round(nparams[i] * bpw).astype(np.int64))
        cs.append(rng.uniform(0.5, 2.0) * np.exp(-1.3 * bpw) * (1 + 0.05 * rng.normal(size=m)))
    return MCKProblem(ws, cs, nparams=nparams)


@functools.lru_cache(maxsize=None)
def instance(name: str) -> MCKProblem:
    if name.startswith("random"):
        return random_instance(1000, 20, seed=int(name.rsplit("#", 1)[1]))
    from mixbits.formats import Measurement, projection_shapes

    path = DATA / "measurement.json"
    if not path.exists():
        pytest.skip(f"{path} not found (CI places shared/ beside the clone)")
    return MCKProblem.from_measurement(Measurement.load(path), 2.0, projection_shapes(HF_CONFIG))


def milp_solve(p: MCKProblem, budget: int):
    sizes = [len(w) for w in p.weights]
    n = sum(sizes)
    c = np.concatenate(p.costs)
    scale = 1.0 / float(np.abs(c).max())  # HiGHS' gaps are absolute: work near 1
    w = np.concatenate(p.weights).astype(np.float64)
    one_each = csr_matrix((np.ones(n), (np.repeat(np.arange(p.n_slots), sizes), np.arange(n))),
                          shape=(p.n_slots, n))
    r = milp(c * scale, constraints=[LinearConstraint(one_each, 1, 1), LinearConstraint(w[None, :], -np.inf, budget)],
             integrality=np.ones(n), bounds=Bounds(0, 1), options={"time_limit": 120.0})
    x = np.round(r.x).astype(int)
    edges = np.cumsum([0] + sizes)
    choice = [int(np.argmax(x[edges[i]:edges[i + 1]])) for i in range(p.n_slots)]
    return p.evaluate(choice), r


def _format(rows, meta):
    out = [f"{'instance':<18} {'bpw':>5} {'slots':>5} {'opts':>5} {'mixbits ms':>11} {'milp ms':>9} "
           f"{'speedup':>8} {'cost mixbits':>14} {'cost milp':>14} {'gap to LB':>10} {'states':>7}"]
    by = {}
    for r in rows:
        by.setdefault((r["instance"], r["bpw"]), {})[r["impl"]] = r
    for (name, bpw), d in by.items():
        a, b = d.get("mixbits"), d.get("milp")
        if not a:
            continue
        ms_b = f"{b['ms']:9.1f}" if b else f"{'-':>9}"
        sp = f"{b['ms'] / a['ms']:7.1f}x" if b else f"{'-':>8}"
        cb = f"{b['cost']:14.8g}" if b else f"{'-':>14}"
        out.append(f"{name:<18} {bpw:>5} {a['slots']:>5} {a['options']:>5} {a['ms']:11.1f} {ms_b} {sp} "
                   f"{a['cost']:14.8g} {cb} {a['gap']:10.2e} {a['states']:>7}")
    return "\n".join(out)


def _cases(full: bool):
    quick = [("random 1000x20 #0", 4.0), ("exl2 measurement", 4.0)]
    if not full:
        return quick
    return [(f"random 1000x20 #{s}", b) for s in (0, 1, 2) for b in (2.5, 3.0, 4.0, 5.0, 6.0)] + \
           [("exl2 measurement", b) for b in (2.6, 3.0, 4.0, 5.0, 6.5)]


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        full = metafunc.config.getoption("--bench-full")
        cases = _cases(full)
        metafunc.parametrize("case", cases, ids=[f"{n}@{b}" for n, b in cases])


@pytest.mark.parametrize("impl", ["mixbits", "milp"])
def test_alloc(benchmark, bench_table, case, impl):
    name, bpw = case
    p = instance(name)
    budget = p.budget_from_bpw(bpw)
    table = bench_table("alloc", _format)
    table.meta["baseline"] = "scipy.optimize.milp (HiGHS), same instance, same run"
    if impl == "mixbits":
        sol = benchmark.pedantic(solve, args=(p, budget), rounds=5, iterations=1, warmup_rounds=1)
        cost, bits = sol.cost, sol.bits
        extra = {"gap": sol.gap, "states": sol.stats["peak_states"]}
    else:
        ((cost, bits), r) = benchmark.pedantic(milp_solve, args=(p, budget), rounds=1, iterations=1)
        assert r.status == 0, r.message  # 1 would mean the time limit, not an optimum
        extra = {"gap": float("nan"), "states": 0}
        ours = solve(p, budget)
        # both optimal: HiGHS may stop within its tolerance above the exact optimum, never below
        assert ours.cost <= cost * (1 + 1e-9) and cost <= ours.cost * (1 + 1e-4)
    assert bits <= budget
    table.add({"instance": name, "bpw": bpw, "impl": impl, "ms": benchmark.stats.stats.median * 1e3,
               "cost": cost, "bits": bits, "slots": p.n_slots,
               "options": int(np.mean([len(w) for w in p.weights]).round()), **extra})
