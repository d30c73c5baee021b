"""The sharded sweep on an 8B-class float checkpoint (issue 40 item 3): the
same exact-sweep table from one process and from two processes launched by
``mlx.launch`` (ring backend on 127.0.0.1), with each process's peak memory
and the wall time of both runs.

    python bench/float_folder.py --shape llama3-8b --out /tmp/llama8b   # 16 GB, once
    python bench/sharded_8b.py --folder /tmp/llama8b

An exact sweep of every tensor of an 8B model is days on this machine
(bench/results/convert_8b_probe.json), so the check measures a few tensors
spread over the depth (``--tensors``) at two candidates on one calibration
sequence: what sharding changes (which rank measures which tensor, the
exchange of parts, the merge) is the same for 4 tensors as for 225, and each
process still loads and runs the whole 8B model (reference pass and replays).
Every KL of the merged table must equal the one-process table's exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_float_linear import cpu_info  # noqa: E402

GiB = 1024 ** 3
DEFAULT_TENSORS = ["model.layers.0.self_attn.q_proj", "model.layers.11.mlp.down_proj",
                   "model.layers.20.self_attn.v_proj", "model.layers.31.mlp.gate_proj"]


def run(argv: list[str], env: dict) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    r = subprocess.run(argv, env=env, capture_output=True, text=True)
    return time.perf_counter() - t0, r.returncode, r.stdout + r.stderr


def peaks(output: str) -> list[float]:
    """Every 'peak memory X GiB' line the processes printed (one per process)."""
    return [float(v) for v in re.findall(r"peak memory ([\d.]+) GiB", output)]


def kls(table_path: Path) -> dict:
    t = json.loads(table_path.read_text())
    return {(e["path"], c["kind"]): c["kl"] for e in t["entries"] for c in e["candidates"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", required=True, help="a float folder (bench/float_folder.py) with tokens.npy")
    ap.add_argument("--tensors", nargs="+", default=DEFAULT_TENSORS)
    ap.add_argument("--candidates", nargs="+", default=["2b_g64", "4b_g64"])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--work", default="/tmp/mixbits-sharded-8b")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sharded_8b.json"))
    a = ap.parse_args(argv)
    folder, work = Path(a.folder), Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tokens = np.load(folder / "tokens.npy")[:1, : a.seq_len]
    np.save(work / "tokens.npy", tokens)
    launch = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or shutil.which("mlx.launch")
    if launch is None:
        raise SystemExit("mlx.launch not found next to this Python")
    env = dict(os.environ, MIXBITS_NUM_THREADS="1")

    def measure(out: Path) -> list[str]:
        return [sys.executable, "-m", "mixbits", "measure", "--model", str(folder),
                "--tokens", str(work / "tokens.npy"), "--dtype", a.dtype, "--method", "exact",
                "--candidates", *a.candidates, "--tensors", *a.tensors, "--out", str(out)]

    result = {"host": cpu_info(), "folder": str(folder),
              "config": json.loads((folder / "config.json").read_text()),
              "tokens": list(tokens.shape), "tensors": a.tensors, "candidates": a.candidates,
              "dtype": a.dtype, "threads_per_process": 1,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": os.getloadavg()[0]}
    print(f"{folder}; host {result['host']['cpu']}, load {os.getloadavg()[0]:.1f}", flush=True)

    secs, rc, out = run(measure(work / "one.json"), env)
    print(out[-1500:], flush=True)
    result["one_process"] = {"rc": rc, "wall_s": round(secs, 1), "peak_rss_gib": peaks(out)}
    if rc != 0:
        raise SystemExit(f"one-process sweep failed (exit {rc})")

    port = 20000 + os.getpid() % 20000
    secs, rc, out = run([launch, "--backend", "ring", "-n", "2", "--starting-port", str(port), "--",
                         *measure(work / "two.json")], env)
    print(out[-1500:], flush=True)
    result["two_processes"] = {"rc": rc, "wall_s": round(secs, 1), "peak_rss_gib": peaks(out),
                               "load_after": os.getloadavg()[0]}
    if rc != 0:
        raise SystemExit(f"two-process sweep failed (exit {rc})")

    one, two = kls(work / "one.json"), kls(work / "two.json")
    parts = [kls(p) for p in sorted(work.glob("two.rank*-of-2.json"))]
    result["same_table"] = one == two
    result["kl"] = {f"{p} {c}": v for (p, c), v in sorted(one.items())}
    result["pairs_per_rank"] = [len(p) for p in parts]
    result["max_abs_diff"] = max(abs(one[k] - two.get(k, float("inf"))) for k in one)
    print(f"same table: {result['same_table']} (max |diff| {result['max_abs_diff']:g}); "
          f"pairs per rank {result['pairs_per_rank']}", flush=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0 if result["same_table"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
