"""A sweep sharded over two processes (mlx.launch, ring backend on
localhost) gives the same table as one process."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

from mixbits.measure.sweep import sweep  # noqa: E402
from tiny_model import tiny_llama, tiny_tokens  # noqa: E402

HERE = Path(__file__).resolve().parent


def strip(t):
    return [{k: v for k, v in e.items() if k != "seconds"} for e in t["entries"]]


def test_two_ranks_equal_one_process(tmp_path):
    launch = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or shutil.which("mlx.launch")
    if launch is None:
        pytest.skip("mlx.launch not found next to this Python")
    single = sweep(tiny_llama(layers=2), tiny_tokens(n=2), tmp_path / "one.json",
                   ["2b_g64", "4b_g64", "ternary_g64"], progress=False)
    out = tmp_path / "two.json"
    env = dict(os.environ, PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MIXBITS_NUM_THREADS="1")
    port = 20000 + os.getpid() % 20000
    r = subprocess.run([launch, "--backend", "ring", "-n", "2", "--starting-port", str(port),
                        "--", sys.executable, str(HERE / "dist_worker.py"), str(out)],
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    merged = json.loads(out.read_text())
    assert merged["complete"] and merged["meta"] == single["meta"]
    assert strip(merged) == strip(single)
    # each rank kept its own resumable part
    parts = sorted(p.name for p in tmp_path.glob("two.rank*-of-2.json"))
    assert parts == ["two.rank0-of-2.json", "two.rank1-of-2.json"]
    ranks = [json.loads((tmp_path / p).read_text()) for p in parts]
    assert {e["path"] for e in ranks[0]["entries"]}.isdisjoint({e["path"] for e in ranks[1]["entries"]})
