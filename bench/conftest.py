"""Shared pytest fixtures for the benchmark suites in bench/.

- ``probe_gbps``: multithreaded stream-read bandwidth (GB/s) over a buffer
  much larger than the caches, measured once per session: the roofline for
  memory-bound kernels, from the same run as the kernels.
- ``bench_table``: suites add rows (dicts) to a named table; every table is
  printed at the end of the session and saved as bench/results/<name>.json.
- ``--bench-full``: suites run their full case list instead of a quick one.

Run with the baselines' BLAS at full speed: numpy reads OPENBLAS_CORETYPE /
OPENBLAS_L2_SIZE at import, so unset them for the benchmark command only:
``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m pytest bench``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parent / "results"
_TABLES: dict[str, dict] = {}


def pytest_addoption(parser):
    parser.addoption("--bench-full", action="store_true", default=False,
                     help="run the full benchmark case lists (default: quick subsets)")


@pytest.fixture(scope="session")
def bench_full(request) -> bool:
    return bool(request.config.getoption("--bench-full"))


@pytest.fixture(scope="session")
def probe_gbps() -> float:
    from mixbits import _ext

    return float(_ext.read_bandwidth_gbps(1 << 30, 5))


class Table:
    def __init__(self, name: str, formatter=None):
        self.name, self.rows, self.meta, self.formatter = name, [], {}, formatter

    def add(self, row: dict) -> None:
        self.rows.append(row)


@pytest.fixture(scope="session")
def bench_table():
    """bench_table(name, formatter=None) -> Table; formatter(rows, meta) -> str."""

    def get(name: str, formatter=None) -> Table:
        if name not in _TABLES:
            _TABLES[name] = Table(name, formatter)
        return _TABLES[name]

    return get


def _jsonable(o):
    return dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o)


def pytest_terminal_summary(terminalreporter):
    for name, t in _TABLES.items():
        if not t.rows:
            continue
        terminalreporter.section(f"bench table: {name}")
        text = t.formatter(t.rows, t.meta) if t.formatter else "\n".join(map(str, t.rows))
        terminalreporter.write_line(text)
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"{name}.json"
        tmp = path.with_suffix(".json.tmp")
        with open(tmp, "w") as f:
            json.dump({"meta": t.meta, "rows": t.rows}, f, indent=1, default=_jsonable)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        terminalreporter.write_line(f"saved {path}")
