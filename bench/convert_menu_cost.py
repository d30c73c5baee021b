"""What refining with both candidate menus costs (issue 41 items 2-3):
``mixbits convert`` of one model at the same budgets, ``--menu default``
and ``--menu both`` (the new default), started together on the same
machine so both see the same load; per stage seconds from each run's
timings.json, wall seconds, the load average sampled every ~20 s, and what
``both`` decided at each budget (both menus' calibration joint KL, the one
kept).

The two runs share the host's cores (each given MIXBITS_NUM_THREADS, 1 by
default on a 2-core host), so their times are comparable with each other,
not with a run on an idle machine. The joint evaluator sizes its caches
from the available memory; on a shared host the children are told that
``--avail-gib`` is available (the caches then hold at most 3/8 and 1/8
of it), which bounds their resident set. The calibration tokens are
convert's default cut (seed 0 of bench/quality_protocol.py), so the
allocations can be scored on held-out text afterwards with
``quality_protocol.py --work WORK/<menu> --no-convert --seeds 0``.

Run:  python bench/convert_menu_cost.py --model smollm2 --bpw 4.5 5.0 --method grad \\
          --work /tmp/qpm --out bench/results/convert_menu_cost_smollm2.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def child(argv: list[str], avail_gib: float) -> int:
    import mixbits.streaming as streaming
    from mixbits.cli import main

    streaming.available_memory = lambda: int(avail_gib * 2 ** 30)
    return main(argv)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[3:], float(sys.argv[2])))
    from quality_protocol import host

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--bpw", type=float, nargs="+", default=[4.5, 5.0])
    ap.add_argument("--method", default="grad")
    ap.add_argument("--max-evals", type=int, default=30)
    ap.add_argument("--menus", nargs="+", default=["default", "both"])
    ap.add_argument("--tokens", help="calibration ids (.npy) instead of convert's default cut")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--avail-gib", type=float, default=4.0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/qpm"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    runs = {}
    env = dict(os.environ, MIXBITS_NUM_THREADS=str(args.threads))
    for menu in args.menus:
        out = args.work / menu / "seed0" / Path(args.model).name
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = ["convert", "--model", args.model, "--bpw", *[f"{b:g}" for b in args.bpw], "--out", str(out),
               "--method", args.method, "--max-evals", str(args.max_evals), "--menu", menu, *(["--tokens", args.tokens] if args.tokens else [])]
        log = open(args.work / f"{menu}.log", "w")
        runs[menu] = {"cmd": cmd, "out": out, "t0": time.perf_counter(), "log": log,
                      "proc": subprocess.Popen([sys.executable, __file__, "--child", str(args.avail_gib), *cmd],
                                               env=env, stdout=log, stderr=subprocess.STDOUT)}
    loads, t_start = [], time.perf_counter()
    tick = 0
    while any(r["proc"].poll() is None for r in runs.values()):
        if tick % 10 == 0:
            loads.append([round(time.perf_counter() - t_start), *os.getloadavg()])
        for r in runs.values():
            if r["proc"].poll() is not None and "wall_s" not in r:
                r["wall_s"] = round(time.perf_counter() - r["t0"], 1)
        time.sleep(2)
        tick += 1
    result = {"note": __doc__.split("\n\n")[0].replace("\n", " "), "host": host(),
              "model": args.model, "budgets": args.bpw, "method": args.method, "max_evals": args.max_evals,
              "threads_per_run": args.threads, "avail_gib_told": args.avail_gib,
              "load_avg_samples": loads, "load_1min_mean": round(sum(x[1] for x in loads) / max(1, len(loads)), 2),
              "runs": {}}
    for menu, r in runs.items():
        r.setdefault("wall_s", round(time.perf_counter() - r["t0"], 1))
        work = Path(str(r["out"]) + ".work")
        timings = json.loads((work / "timings.json").read_text()) if (work / "timings.json").exists() else None
        per = {}
        for b in args.bpw:
            f = work / f"allocation_{b:g}bpw.json"
            if f.exists():
                a = json.loads(f.read_text())
                per[f"{b:g}"] = {"calibration_joint_kl": a["guard"]["joint_kl"], "written": a["guard"]["written"],
                                 "average_bpw_storage": a.get("average_bpw_storage"), "menu": a.get("menu")}
        result["runs"][menu] = {"command": "mixbits " + " ".join(r["cmd"]), "returncode": r["proc"].returncode,
                                "wall_s": r["wall_s"], "stage_s": timings, "allocations": per}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, args.out)
    for menu, r in result["runs"].items():
        print(menu, r["returncode"], r["wall_s"], r["stage_s"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
