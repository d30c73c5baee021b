"""Follow-up to bench/two_stage_refine.py, on the tables its run left in its
temporary directory (the sweeps are deterministic; this re-runs no sweep).

The run's budget rule (0.25 x exact - two-stage - 2% margin) left 3.3 CPU s
for refinement because two-stage cost 0.224x exact in that run, so its
refinement got one evaluation at 4.5 bpw and none at 3.5. Here:
  (a) "at the bound": the same refinement with budget 0.25 x exact - two-stage,
      no margin (the run's CPU seconds), split evenly over 3.5 and 4.5 bpw
      after the evaluator build; an evaluation is refused (+inf, never kept)
      when it would end past the target's deadline by the last evaluation's
      cost;
  (b) "CLI default": max_evals=30 per target (`mixbits refine`'s default),
      no CPU bound, to show what refinement does regardless of cost.
Both tables (exact, two-stage) get both; every allocation is scored on the
run's 8 x 256 held-out sequences. Result added under "followup" in the run's
JSON.

Run:  nice -n 5 env MIXBITS_NUM_THREADS=1 python bench/two_stage_refine_followup.py TMPDIR \
          >> bench/results/smollm2/two_stage_refine_followup.log
"""
import json
import math
import sys
import time
from pathlib import Path

import mixbits
from mixbits.measure.calib import load_texts, token_sequences
from mixbits.measure.joint import JointEvaluator
from mixbits.measure.refine import allocate_table, refine
from mixbits.models import load

d = Path(sys.argv[1])
OUT = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("bench/results/smollm2/two_stage_refine.json")
rec = json.loads(OUT.read_text())
tables = {"exact": json.loads((d / "exact.json").read_text()), "two-stage": json.loads((d / "two.json").read_text())}
targets = [3.5, 4.5]
model, tok, _ = load("smollm2")
mixbits.patch(model)
toks = token_sequences(tok, load_texts(None, "auto"), 10, 256)
cal, held = toks[:1], toks[2:]
exact_cpu, two_cpu = rec["cpu_seconds"]["exact"], rec["cpu_seconds"]["two-stage"]
fu = {"what": "refinement of the run's tables (same tables, re-read from its temporary directory), "
              "in a second process after the run",
      "command": "nice -n 5 env MIXBITS_NUM_THREADS=1 python bench/two_stage_refine_followup.py TMPDIR",
      "budget_at_bound_cpu_s": round(0.25 * exact_cpu - two_cpu, 1), "variants": {}}
rec["followup"] = fu


def save():
    OUT.write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps({k: v for k, v in fu.items() if k != "detail"}, indent=1), flush=True)


class Guard:
    def __init__(self, ev, deadline):
        self.ev, self.deadline, self.real, self.refused, self.last = ev, deadline, 0, 0, 0.0
        self.tokens, self.n_chunks = ev.tokens, ev.n_chunks

    def joint_kl(self, assignment, chunks=None):
        now = time.process_time()
        if now + self.last > self.deadline:
            self.refused += 1
            return math.inf, 0.0
        self.real += 1
        r = self.ev.joint_kl(assignment, chunks)
        self.last = time.process_time() - now
        return r


allocs = {}
for name in tables:
    for bpw in targets:
        a, _, _ = allocate_table(tables[name], bpw)
        allocs[(name, bpw)] = {x["path"]: x["kind"] for x in a["assignment"]}
fu["detail"] = {}
for variant, max_evals, bounded in (("at the bound", 100, True), ("CLI default (30 evals)", 30, False)):
    fu["variants"][variant] = {"cpu_seconds": {}, "evaluations": {}}
    for name in ("two-stage", "exact"):
        c = time.process_time()
        ev = JointEvaluator(model, cal, chunk=4)
        per_target = (fu["budget_at_bound_cpu_s"] - (time.process_time() - c)) / len(targets)
        for bpw in targets:
            g = Guard(ev, time.process_time() + per_target if bounded else math.inf)
            a = refine(tables[name], g, bpw, max_evals=max_evals, progress=False)
            allocs[(f"{name}+refine [{variant}]", bpw)] = {x["path"]: x["kind"] for x in a["assignment"]}
            jr = a["joint_refine"]
            fu["variants"][variant]["evaluations"][f"{name}@{bpw}"] = g.real
            fu["detail"][f"{name}+refine [{variant}]@{bpw}"] = {
                "real_evaluations": g.real, "refused": g.refused,
                "cal_joint_kl_before": jr["joint_kl_before"], "cal_joint_kl_after": jr["joint_kl_after"],
                "starts": jr["starts"], "swaps_kept": jr["swaps"], "log": jr["log"]}
            print(f"{variant} {name} {bpw}: cal {jr['joint_kl_before']:.4f} -> {jr['joint_kl_after']:.4f}, "
                  f"{g.real} evals, {g.refused} refused", flush=True)
        cpu = time.process_time() - c
        fu["variants"][variant]["cpu_seconds"][f"{name} refine"] = round(cpu, 1)
        base = exact_cpu if name == "exact" else two_cpu
        fu["variants"][variant]["cpu_seconds"][f"{name} + refine"] = round(base + cpu, 1)
        fu["variants"][variant].setdefault("cost_vs_exact", {})[f"{name} + refine"] = round((base + cpu) / exact_cpu, 4)
        save()

hev = JointEvaluator(model, held, chunk=4)
kl = {f"{b}": {} for b in targets}
for (name, bpw), asg in allocs.items():
    kl[f"{bpw}"][name] = round(hev.joint_kl(asg)[0], 5)
fu["heldout_8x256_joint_kl"] = kl
fu["vs_exact"] = {b: {n: round(v / kl[b]["exact"] - 1, 4) for n, v in kl[b].items() if n != "exact"} for b in kl}
save()
print("done", flush=True)
