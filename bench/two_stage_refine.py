"""Two-stage sweep + joint-KL refinement vs the exact sweep on SmolLM2-135M,
one run: does refining the two-stage allocation on the calibration tokens
close its 3.5 bpw held-out gap while the whole pipeline stays within 1/4
of the exact sweep's cost?

Run:  nice -n 5 env MIXBITS_NUM_THREADS=1 python bench/two_stage_refine.py \
          > bench/results/smollm2/two_stage_refine.log
Writes bench/results/smollm2/two_stage_refine.json (also after each stage).

Same setup as bench/grad_cost.py 1: calibration 1 x 256 Botchan tokens,
candidates 2b/3b/4b/8b g64, two-stage budget 0.15; held out: 8 x 256 later
sequences ([2:] of 10, as bench/grad_cost_heldout.py).

Budget rule (CPU seconds of this process, time.process_time):
  refine_budget = 0.25 * exact_cpu - two_stage_cpu - 2% of exact (margin),
which pays for the calibration JointEvaluator (reference logits) and both
targets' refinements; after the evaluator is built, what is left is split
evenly between 3.5 and 4.5 bpw. max_evals per target is set from the measured
cost of one evaluation, and a guard refuses (scores +inf, never kept, costs
nothing) any evaluation that would start past the target's CPU deadline, so
the bound holds even if the estimate is off. The exact allocation is refined
with the same max_evals and the same CPU allowance per target.
"""
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import mixbits
from mixbits.measure.calib import load_texts, token_sequences
from mixbits.measure.joint import JointEvaluator
from mixbits.measure.refine import allocate_table, refine
from mixbits.measure.sweep import sweep
from mixbits.measure.two_stage import proxy_sweep
from mixbits.models import load

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("bench/results/smollm2/two_stage_refine.json")
cands = ["2b_g64", "3b_g64", "4b_g64", "8b_g64"]
targets = [3.5, 4.5]
model, tok, _ = load("smollm2")
mixbits.patch(model)
toks = token_sequences(tok, load_texts(None, "auto"), 10, 256)
cal, held = toks[:1], toks[2:]  # calibration as grad_cost.py 1; held out as grad_cost_heldout.py
SMOKE = os.environ.get("SMOKE")  # quick check of the script: 6 tensors, 1 held-out sequence
sites = None
if SMOKE:
    from mixbits.adapter import ModelAdapter
    sites = [s.path for s in ModelAdapter(model).sites][:6]
    held, OUT = toks[2:3], Path(tempfile.mkdtemp()) / "smoke.json"
tmp = Path(tempfile.mkdtemp())
print(f"tables in {tmp}", flush=True)
out = {"what": "SmolLM2-135M, all tensors x 4 candidates (2b_g64 3b_g64 4b_g64 8b_g64), calibration "
               "1 x 256 Botchan tokens, held out 8 x 256 later sequences; exact sweep, two-stage sweep "
               "(budget 0.15), joint-KL refinement (mixbits.measure.refine.refine, swaps, default powers) "
               "of both tables' allocations on the calibration tokens; one run",
       "cpu_seconds": {}, "wall_seconds": {}}


def save():
    if "exact" in out["cpu_seconds"]:
        ex = out["cpu_seconds"]["exact"]
        out["cost_vs_exact"] = {k: round(v / ex, 4) for k, v in out["cpu_seconds"].items()}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "refine_detail"}, indent=1), flush=True)


class Guard:
    """Evaluator wrapper: evaluations that would start after ``deadline``
    (process_time) are refused (+inf, so refine never keeps them)."""

    def __init__(self, ev, deadline):
        self.ev, self.deadline, self.real, self.refused = ev, deadline, 0, 0
        self.tokens, self.n_chunks = ev.tokens, ev.n_chunks

    def joint_kl(self, assignment, chunks=None):
        if time.process_time() >= self.deadline:
            self.refused += 1
            return math.inf, 0.0
        self.real += 1
        return self.ev.joint_kl(assignment, chunks)


tables = {}
t, c = time.perf_counter(), time.process_time()
tables["exact"] = sweep(model, cal, tmp / "exact.json", cands, sites=sites, progress=False)
out["wall_seconds"]["exact"], out["cpu_seconds"]["exact"] = round(time.perf_counter() - t, 1), round(time.process_time() - c, 1)
save()
t, c = time.perf_counter(), time.process_time()
tables["two-stage"] = proxy_sweep(model, cal, tmp / "two.json", cands, method="two-stage", targets=targets,
                                  budget=0.15, sites=sites, progress=False)
out["wall_seconds"]["two-stage"], out["cpu_seconds"]["two-stage"] = round(time.perf_counter() - t, 1), round(time.process_time() - c, 1)
m = tables["two-stage"]["meta"]
out["two_stage"] = {k: m[k] for k in ("exact_budget", "rounds", "exact_pairs", "exact_tensors",
                                      "exact_cost_share", "exact_seconds")}
save()

exact_cpu = out["cpu_seconds"]["exact"]
budget = 0.25 * exact_cpu - out["cpu_seconds"]["two-stage"] - 0.02 * exact_cpu
out["refine_budget"] = {"rule": "0.25 * exact - two-stage - 0.02 * exact (margin), CPU s; "
                                "evaluator build counted, rest split evenly over 3.5 and 4.5 bpw",
                        "cpu_seconds": round(budget, 1)}
allocs = {}
out["refine_detail"] = {}


def run_refine(name, per_target, max_evals):
    """Refine ``name``'s table at both targets on a fresh calibration
    evaluator; returns CPU and wall seconds (evaluator build included)."""
    t, c = time.perf_counter(), time.process_time()
    ev = JointEvaluator(model, cal, chunk=4)
    build = time.process_time() - c
    if per_target is None:  # first call decides the allowance from what is left after the build
        per_target = (budget - build) / len(targets)
    for bpw in targets:
        g = Guard(ev, time.process_time() + per_target)
        if max_evals is None:  # estimate one evaluation's cost on the DP start (cached for refine after)
            alloc0, _, _ = allocate_table(tables[name], bpw)
            c0 = time.process_time()
            g.joint_kl({a["path"]: a["kind"] for a in alloc0["assignment"]})
            first = time.process_time() - c0
            c0 = time.process_time()
            g.joint_kl({a["path"]: a["kind"] for a in alloc0["assignment"]})
            one = max(time.process_time() - c0, 1e-3)
            max_evals = min(100, max(1, int((g.deadline - time.process_time()) / one)))
            out["refine_budget"].update({"first_eval_cpu_s": round(first, 2), "eval_cpu_s": round(one, 2),
                                         "max_evals": max_evals, "per_target_cpu_s": round(per_target, 1)})
            print(f"one evaluation {one:.2f} CPU s (first {first:.2f}); max_evals {max_evals}", flush=True)
        a = refine(tables[name], g, bpw, max_evals=max_evals, progress=False)
        allocs[(f"{name}+refine", bpw)] = {x["path"]: x["kind"] for x in a["assignment"]}
        jr = a["joint_refine"]
        out["refine_detail"][f"{name}+refine@{bpw}"] = {
            "real_evaluations": g.real, "refused_evaluations": g.refused,
            "cal_joint_kl_before": jr["joint_kl_before"], "cal_joint_kl_after": jr["joint_kl_after"],
            "starts": jr["starts"], "swaps_kept": jr["swaps"], "log": jr["log"],
            "average_bpw_storage": a.get("average_bpw_storage")}
        print(f"{name} {bpw}: cal joint KL {jr['joint_kl_before']:.4f} -> {jr['joint_kl_after']:.4f}, "
              f"{g.real} evals ({g.refused} refused)", flush=True)
    return time.process_time() - c, time.perf_counter() - t, per_target, max_evals


cpu, wall, per_target, max_evals = run_refine("two-stage", None, None)
out["cpu_seconds"]["two-stage refine"], out["wall_seconds"]["two-stage refine"] = round(cpu, 1), round(wall, 1)
out["cpu_seconds"]["two-stage + refine"] = round(out["cpu_seconds"]["two-stage"] + cpu, 1)
save()
cpu, wall, _, _ = run_refine("exact", per_target, max_evals)
out["cpu_seconds"]["exact refine"], out["wall_seconds"]["exact refine"] = round(cpu, 1), round(wall, 1)
out["cpu_seconds"]["exact + refine"] = round(exact_cpu + cpu, 1)
save()

for name in ("exact", "two-stage"):
    for bpw in targets:
        a, _, _ = allocate_table(tables[name], bpw)
        allocs[(name, bpw)] = {x["path"]: x["kind"] for x in a["assignment"]}
hev = JointEvaluator(model, held, chunk=4)
out["heldout_8x256_joint_kl"] = {f"{b}": {} for b in targets}
for name in ("exact", "exact+refine", "two-stage", "two-stage+refine"):
    for bpw in targets:
        kl, se = hev.joint_kl(allocs[(name, bpw)])
        out["heldout_8x256_joint_kl"][f"{bpw}"][name] = round(kl, 5)
        out["heldout_8x256_joint_kl"][f"{bpw}"][f"{name} (se)"] = round(se, 5)
out["vs_exact"] = {f"{b}": {n: round(out["heldout_8x256_joint_kl"][f"{b}"][n]
                                    / out["heldout_8x256_joint_kl"][f"{b}"]["exact"] - 1, 4)
                            for n in ("exact+refine", "two-stage", "two-stage+refine")} for b in targets}
out["goals"] = {"cost_two_stage_plus_refine_le_0.25": {"value": round(out["cpu_seconds"]["two-stage + refine"] / exact_cpu, 4),
                                                       "met": out["cpu_seconds"]["two-stage + refine"] / exact_cpu <= 0.25},
                "two_stage_plus_refine_within_2pct_of_exact": {f"{b}": {"value": out["vs_exact"][f"{b}"]["two-stage+refine"],
                                                                        "met": out["vs_exact"][f"{b}"]["two-stage+refine"] <= 0.02}
                                                               for b in targets}}
save()
print("done", flush=True)
