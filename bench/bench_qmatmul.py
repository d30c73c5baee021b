"""Quantized matmul under pytest-benchmark: mixbits, mx.quantized_matmul and
numpy float32 on the dequantized weights, case by case in the same run, plus
the bandwidth probe. Same cases and table as ``mixbits bench``.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m pytest bench/bench_qmatmul.py [--bench-full]
"""

from __future__ import annotations

import functools

import pytest

from mixbits.commands import bench as qb

IMPLS = ["mixbits", "mlx", "numpy"]
_ROWS: dict = {}


def _case_list(full: bool):
    return [(c, impl) for c in qb.cases(full) for impl in IMPLS]


def pytest_generate_tests(metafunc):
    if "case_impl" in metafunc.fixturenames:
        full = metafunc.config.getoption("--bench-full")
        items = _case_list(full)
        metafunc.parametrize("case_impl", items, ids=[f"{c.id}-{i}" for c, i in items])


@functools.lru_cache(maxsize=1)
def _weights(n, k, kind):
    return qb.Weights(n, k, kind)


def test_qmatmul(benchmark, case_impl, probe_gbps, bench_table):
    case, impl = case_impl
    wt = _weights(case.n, case.k, case.kind)
    fns = qb.runners(wt, qb.make_x(case))
    table = bench_table("qmatmul", lambda rows, meta: qb.format_table(rows, meta["probe_gbps"]))
    table.meta["probe_gbps"] = probe_gbps
    row = _ROWS.get(case)
    if row is None:
        row = _ROWS[case] = qb.Row(case, wt.bpw, wt.nbytes)
    if impl == "mlx":
        t1 = (row.best("mlx") if case.m == 1 else None) or qb.mlx_estimate(
            qb.runners(wt, qb.make_x(qb.Case(case.n, case.k, 1, case.kind)))["mlx"])
        est = t1 * case.m
        if est > qb.MLX_BUDGET_S:
            row.times["mlx"] = {"skipped": f"estimated {est:.1f} s per call", "estimate_s": est}
            pytest.skip(f"MLX's scalar CPU path: estimated {est:.1f} s per call")
    benchmark.group = case.id
    benchmark.extra_info.update({"impl": impl, "weight_bytes": wt.nbytes, "bpw": wt.bpw})
    rounds = 3 if impl == "mlx" and case.m > 1 else 10
    benchmark.pedantic(fns[impl], rounds=rounds, iterations=1, warmup_rounds=1)
    st = benchmark.stats.stats
    row.times[impl] = {"best_s": st.min, "median_s": st.median, "reps": st.rounds}
    if impl == "mixbits":  # the table's rows are cases with a mixbits time
        table.add(row)
