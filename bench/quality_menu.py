"""Candidate-menu A/B on the one quality protocol (issue 41 items 2-3).

Each menu is one run of bench/quality_protocol.py with the same model,
calibration seed(s), held-out sets, contenders and ``--method``, only
``--candidates`` (and, for the small-set case, ``--n-cal``) changed; this
script gathers their results files into one table: per budget, each
menu's held-out KL, its ratio to the best uniform / mlx-lm contender (with
the protocol's paired bootstrap interval), its ratio to the first menu
(same resampling, so the interval says whether the menus differ beyond the
held-out sequences' spread), and each menu's measure + refine seconds.
Each menu's calibration joint KL (what refine's guard scored its allocation
at, read from the run's work folder) is kept beside it, and ``picked`` is
the menu a rule that refines with both menus and keeps the lower
calibration joint KL would write (no held-out text used for the choice).

Run:  python bench/quality_menu.py --out bench/results/quality_menu_smollm2.json \\
          current=/tmp/qp_menu_A/result.json extended=/tmp/qp_menu_B/result.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from quality_protocol import ratio_ci  # noqa: E402


def mixbits_kls(res: dict, budget: float, held: str) -> np.ndarray:
    """[seeds, sequences] per-sequence KLs of mixbits at ``budget``."""
    seeds = res["protocol"]["mixbits_seeds"]
    return np.array([res["records"][f"mixbits @{budget:g} seed{s}"]["kl"][held] for s in seeds])


def calibration_kl(work: Path | None, budget: float) -> float | None:
    """The guard's calibration joint KL of what the run wrote at ``budget``."""
    f = work / f"allocation_{budget:g}bpw.json" if work else None
    if not f or not f.exists():
        return None
    return json.loads(f.read_text())["guard"]["joint_kl"]


def table(menus: dict[str, dict], held: str = "licenses", works: dict | None = None) -> list[dict]:
    names = list(menus)
    first = menus[names[0]]
    rows = []
    for r0 in first["summary"][held]:
        b = r0["budget"]
        row = {"budget": b, "held_out": held, "best_contender": None, "menus": {}}
        base = mixbits_kls(first, b, held)
        for name in names:
            res = menus[name]
            r = next((x for x in res["summary"].get(held, []) if x["budget"] == b), None)
            if r is None:  # a budget this menu's run did not reach: left out, not guessed
                row["menus"][name] = None
                continue
            best = r["contenders"][0]
            row["best_contender"] = {"name": best["name"], "bpw": best["bpw"], "kl": best["kl"]}
            ours = mixbits_kls(res, b, held)
            entry = {"kl": r["mixbits_kl"], "bpw": r["mixbits_bpw"], "written": r["mixbits_written"],
                     "calibration_joint_kl": calibration_kl((works or {}).get(name), b),
                     "ratio_to_best": best["ratio"], "ratio_to_best_ci95": best["ratio_ci95"]}
            if name != names[0]:
                entry[f"ratio_to_{names[0]}"], entry[f"ratio_to_{names[0]}_ci95"] = ratio_ci(ours, base)
            row["menus"][name] = entry
        cal = {n: e["calibration_joint_kl"] for n, e in row["menus"].items() if e and e["calibration_joint_kl"]}
        row["picked"] = min(cal, key=cal.get) if len(cal) == len(names) else None
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("menus", nargs="+", metavar="NAME=RESULT.json",
                    help="the first is the reference menu the others are paired against")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--note", default="", help="free text kept in the file (host load, what differs)")
    args = ap.parse_args()
    menus, meta, works = {}, {}, {}
    for spec in args.menus:
        name, _, path = spec.partition("=")
        res = json.loads(Path(path).read_text())
        # the convert work folder of seed 0, as quality_protocol lays out --work
        works[name] = Path(path).parent / "seed0" / f"{res['model']}.work"
        menus[name] = res
        meta[name] = {"convert_options": res.get("convert_options"), "command": res["command"],
                      "calibration": res["protocol"]["calibration"], "host": res["host"],
                      "stage_wall_s": res["mixbits_stage_wall_s"]}
    if len({m["calibration"] for m in meta.values()}) > 1:
        raise SystemExit("the menus were run on different calibration sets: not an A/B")
    out = {"note": args.note, "menus": meta, "held_out": {h: table(menus, h, works) for h in
                                                          next(iter(menus.values()))["summary"]}}
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    os.replace(tmp, args.out)
    names = list(menus)
    for row in out["held_out"]["licenses"]:
        c = row["best_contender"]
        cells = []
        for n in names:
            e = row["menus"][n]
            if e is None:
                cells.append(f"{n} -")
                continue
            cell = (f"{n} {e['kl']:.4f} ({e['ratio_to_best']:.2f} [{e['ratio_to_best_ci95'][0]:.2f}, "
                    f"{e['ratio_to_best_ci95'][1]:.2f}])")
            if f"ratio_to_{names[0]}" in e:
                lo, hi = e[f"ratio_to_{names[0]}_ci95"]
                cell += f" x{e[f'ratio_to_{names[0]}']:.3f} [{lo:.3f}, {hi:.3f}] of {names[0]}"
            cells.append(cell)
        print(f"{row['budget']:g} bpw | best {c['name']} {c['kl']:.4f} | " + " | ".join(cells)
              + f" | picked {row['picked']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
