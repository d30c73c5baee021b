"""Shared by the SmolLM2 allocation benches: the committed record printed
and written after every step, and the ``--method grad`` table reused from
its file when a killed run is started again."""
import json
import time
from pathlib import Path

from mixbits.measure.two_stage import proxy_sweep


def dump(rec: dict, out_dir: Path) -> None:
    """Write ``result.json`` and print it (a killed run keeps what it finished)."""
    (out_dir / "result.json").write_text(json.dumps(rec, indent=1))
    print(json.dumps(rec, indent=1), flush=True)


def grad_table(model, cal, cands, out_dir: Path) -> tuple[dict, float]:
    """(table, seconds it took): ``out_dir/table.json`` if an earlier run
    wrote it, else the gradient-proxy sweep on ``cal``, written there."""
    t = time.perf_counter()
    path = out_dir / "table.json"
    if path.exists():
        table = json.loads(path.read_text())
    else:
        table = proxy_sweep(model, cal, path, cands, method="grad", samples=1, progress=False)
    return table, table["meta"].get("proxy_seconds", round(time.perf_counter() - t, 1))
