"""convert's projected stage times (the --dry-run timing probe) against
the measured ones (issue 40 items 3-4): ``mixbits convert`` of one model at
one budget with ``--method grad`` and with convert's default method
(two-stage), both runs started together (nice -n 10, MIXBITS_NUM_THREADS
threads each) so they see the same load; while they run, the dry runs of
the same commands print their projections (``--code DIR``: the mixbits
package the dry runs import, e.g. a snapshot of the code before a change,
to record a before/after pair at the same load). The load average is
sampled every ~20 s throughout.

Run:  python bench/convert_projection.py real --work /tmp/cproj            # starts the converts, waits
      python bench/convert_projection.py dry --work /tmp/cproj --tag after  # the dry runs (while they run)
      python bench/convert_projection.py report --work /tmp/cproj --out bench/results/convert_projection_smollm2.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

METHODS = {"grad": ["--method", "grad"], "default": []}  # default: convert's own (two-stage)


def child(code: str | None, avail_gib: float, argv: list[str]) -> int:
    if code:  # another copy of the package (its own _ext beside it): the editable finder stepped around
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
        sys.path.insert(0, code)
    import mixbits
    import mixbits.streaming as streaming
    from mixbits.cli import main

    print(f"mixbits from {mixbits.__file__}", flush=True)
    streaming.available_memory = lambda: int(avail_gib * 2 ** 30)
    return main(argv)


def command(args, name: str, dry: bool) -> list[str]:
    out = args.work / name / "model"
    return ["convert", "--model", args.model, "--bpw", *[f"{b:g}" for b in args.bpw], "--out", str(out),
            "--n-seq", str(args.n_seq), "--max-evals", str(args.max_evals), *METHODS[name],
            *(["--dry-run"] if dry else [])]


def spawn(args, argv, log, code=None):
    env = dict(os.environ, MIXBITS_NUM_THREADS=str(args.threads))
    return subprocess.Popen(["nice", "-n", "10", sys.executable, __file__, "--child", code or "",
                             str(args.avail_gib), *argv], env=env, stdout=log, stderr=subprocess.STDOUT)


def main() -> None:
    if len(sys.argv) > 3 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2] or None, float(sys.argv[3]), sys.argv[4:]))
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=("real", "dry", "report"))
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--bpw", type=float, nargs="+", default=[4.5])
    ap.add_argument("--n-seq", type=int, default=2)
    ap.add_argument("--max-evals", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--avail-gib", type=float, default=4.0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/cproj"))
    ap.add_argument("--code", help="dry: the package folder to import (default: the installed one)")
    ap.add_argument("--tag", default="after")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.phase == "real":
        procs, t0 = {}, time.perf_counter()
        for name in METHODS:
            (args.work / name).mkdir(exist_ok=True)
            log = open(args.work / f"{name}.log", "w")
            procs[name] = {"proc": spawn(args, command(args, name, False), log), "t0": time.perf_counter(),
                           "started_utc": time.strftime("%H:%M:%S", time.gmtime())}
        loads, tick = [], 0
        while any(p["proc"].poll() is None for p in procs.values()):
            if tick % 10 == 0:
                loads.append([round(time.perf_counter() - t0), *os.getloadavg()])
                raw = {"load_avg_samples": loads, "runs": {n: {k: v for k, v in p.items() if k != "proc"}
                                                           for n, p in procs.items()}}
                (args.work / "real.json").write_text(json.dumps(raw, indent=1))
            for p in procs.values():
                if p["proc"].poll() is not None and "wall_s" not in p:
                    p["wall_s"] = round(time.perf_counter() - p["t0"], 1)
                    p["returncode"] = p["proc"].returncode
            time.sleep(2)
            tick += 1
        for p in procs.values():
            p.setdefault("wall_s", round(time.perf_counter() - p["t0"], 1))
            p["returncode"] = p["proc"].returncode
        raw = {"load_avg_samples": loads, "runs": {n: {k: v for k, v in p.items() if k != "proc"}
                                                   for n, p in procs.items()}}
        (args.work / "real.json").write_text(json.dumps(raw, indent=1))
    elif args.phase == "dry":
        res = {}
        for name in METHODS:
            path = args.work / f"dry_{args.tag}_{name}.log"
            with open(path, "w") as log:
                l0 = os.getloadavg()
                t0 = time.perf_counter()
                rc = spawn(args, command(args, name, True), log, args.code).wait()
                res[name] = {"returncode": rc, "wall_s": round(time.perf_counter() - t0, 1),
                             "load_before": l0, "load_after": os.getloadavg(),
                             "utc": time.strftime("%H:%M:%S", time.gmtime()), "code": args.code or "installed"}
        (args.work / f"dry_{args.tag}.json").write_text(json.dumps(res, indent=1))
    else:
        report(args)


def _minutes(s: str) -> float:
    num, unit = re.match(r"([\d.]+) (s|min|h)", s).groups()
    return float(num) * {"s": 1, "min": 60, "h": 3600}[unit]


PROBE = re.compile(r"Fisher pass ([\d.]+) s, exact pair ([\d.]+) s \+ ([\d.]+) s per block, joint evaluation "
                   r"([\d.]+) s .*reference forward ([\d.]+) s; quantizing every tensor once ([\d.]+) s"
                   r"(?:; the proxy's rating of every \(tensor, candidate\) ([\d.]+) s)?")


def _bar_elapsed(log: Path, desc: str) -> float | None:
    """The last elapsed time tqdm printed for bar ``desc`` in a log."""
    text = log.read_text(errors="replace").replace("\r", "\n")
    got = re.findall(rf"^{re.escape(desc)}:.*?\[(?:(\d+):)?(\d+):(\d+)<", text, re.M)
    if not got:
        return None
    h, m, sec = got[-1]
    return int(h or 0) * 3600 + int(m) * 60 + int(sec)


def _bars(log: Path, desc: str) -> list[int]:
    """Each finished bar ``desc``'s elapsed seconds, in order."""
    text = log.read_text(errors="replace").replace("\r", "\n")
    return [int(h or 0) * 3600 + int(m) * 60 + int(sec) for h, m, sec in
            re.findall(rf"^{re.escape(desc)}: 100%.*?\[(?:(\d+):)?(\d+):(\d+)<", text, re.M)]


def projection(args, log: Path, method: str, recompute: bool = True) -> dict:
    """The dry run's probe line, and the stages projected from it by the
    current Probe (the per-sequence figures as printed, 2 decimals); with
    ``recompute`` False (a dry run of other code) the projection it printed
    (rounded as printed)."""
    from mixbits.adapter import ModelAdapter
    from mixbits.convert import Probe
    from mixbits.measure.calib import load_model
    from mixbits.measure.candidates import CONVERT_MENUS, expand_candidates, parse_candidate, supports
    from mixbits.measure.two_stage import pair_costs

    text = log.read_text(errors="replace")
    m = PROBE.search(text)
    printed = [ln for ln in text.splitlines() if ln.startswith(("calibration:", "estimated:", "method:"))]
    if m is None or not recompute:
        est = re.search(r"estimated: measure ~([\d.]+ (?:s|min|h)), refine ~([\d.]+ (?:s|min|h))", text)
        return {"printed": printed, "projected_s": {"measure": _minutes(est.group(1)),
                                                    "refine": _minutes(est.group(2))} if est else None,
                "projected_as": "printed by that code (rounded)"}
    fisher, a, b, joint, ref, build, rating = (float(x) if x else None for x in m.groups())
    ns = argparse.Namespace(model=args.model, dtype="float32")
    model, _ = load_model(ns)
    sites = ModelAdapter(model).sites
    cands = [parse_candidate(c) for c in expand_candidates([c for v in CONVERT_MENUS.values() for c in v])]
    cost = pair_costs([{"path": s.path, "layer": s.block} for s in sites])
    units = [cost[s.path] for s in sites for c in cands if supports(c, s)]
    probe = Probe(args.n_seq, fisher, (a, b), units, joint, ref, build, len(cands), len(CONVERT_MENUS),
                  rate_units=[rating] if rating is not None else [])
    st = probe.stage_seconds(method, args.bpw, args.max_evals, 0.15, 2)
    exact = args.n_seq * sum(a + b * u for u in units)
    out = {"printed": printed,
           "per_sequence_s": {"fisher": fisher, "pair_fixed": a, "pair_per_block": b, "joint": joint,
                              "reference": ref},
           "build_set_s": build, "rating_all_pairs_s": rating,
           "projected_s": {"measure": round(st["measure"], 1), "refine": round(st["refine"], 1),
                           "measure_parts": {"fisher": round(args.n_seq * 2 * fisher, 1),
                                             "rating": rating,
                                             **({"exact": round(0.15 * exact, 1)} if method == "two-stage"
                                                else {})}}}
    return out


def report(args) -> None:
    from quality_protocol import host

    real = json.loads((args.work / "real.json").read_text())
    loads = real["load_avg_samples"]
    res = {"note": __doc__.split("\n\n")[0].replace("\n", " "), "host": host(), "model": args.model,
           "budgets": args.bpw, "n_seq": args.n_seq, "seq_len": 256, "max_evals": args.max_evals,
           "menu": "both (convert's default)", "threads_per_run": args.threads, "nice": 10,
           "avail_gib_told": args.avail_gib,
           "load_avg_samples": loads,
           "load_1min_mean": round(sum(x[1] for x in loads) / max(1, len(loads)), 2), "runs": {}}
    for name in METHODS:
        method = "grad" if name == "grad" else "two-stage"
        r = real["runs"][name]
        work = args.work / name / "model.work"
        timings = json.loads((work / "timings.json").read_text()) if (work / "timings.json").exists() else None
        log = args.work / f"{name}.log"
        row = {"command": "mixbits " + " ".join(command(args, name, False)), "method": method,
               "returncode": r.get("returncode"), "wall_s": r.get("wall_s"), "measured_s": timings,
               "measured_parts_s": {"proxy (Fisher pass + rating, tqdm)": _bar_elapsed(log, "proxy"),
                                    **({"exact stage (tqdm)": _bar_elapsed(log, "exact stage")}
                                       if method == "two-stage" else {})},
               "refine_searches_s (tqdm, in order)": _bars(log, "joint refine")}
        table = work / "table.json"
        if table.exists():
            meta = json.loads(table.read_text()).get("meta", {})
            row["table_meta"] = {k: meta.get(k) for k in ("proxy_seconds", "exact_seconds", "exact_pairs",
                                                          "exact_cost_share")}
        for tag in ("before", "after"):
            dl = args.work / f"dry_{tag}_{name}.log"
            meta = args.work / f"dry_{tag}.json"
            if dl.exists():
                row[f"dry_run_{tag}"] = {**projection(args, dl, method, tag == "after"),
                                         **(json.loads(meta.read_text()).get(name, {}) if meta.exists() else {})}
        res["runs"][name] = row
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    os.replace(tmp, args.out)
    print(json.dumps({n: {k: v for k, v in r.items() if k != "command"} for n, r in res["runs"].items()},
                     indent=1)[:6000])


if __name__ == "__main__":
    main()
