"""Exact vs gradient-proxy vs two-stage sweeps on SmolLM2-135M, one run:
cost of each, and the held-out joint KL of the allocations each table
gives at the same storage budgets.

Run:  python bench/grad_cost.py [N_SEQ] > bench/results/smollm2/grad_vs_exact.log
(prints the record so far after each method; the last block is the result)
Calibration: N_SEQ x 256 Botchan tokens; held out: the next N_SEQ x 256.
The three tables are saved as bench/results/smollm2/grad_tables/{exact,grad,two}.json
(per-tensor KL tables, for bench/grad_cost_heldout.py); the directory must
not hold them yet (move an old run's away first).
"""
import json
import sys
import time
from pathlib import Path

import mixbits
from mixbits.measure.calib import load_texts, token_sequences
from mixbits.measure.joint import JointEvaluator
from mixbits.measure.refine import allocate_table
from mixbits.measure.sweep import sweep
from mixbits.measure.two_stage import proxy_sweep
from mixbits.models import load

n_seq = int(sys.argv[1]) if len(sys.argv) > 1 else 4
cands = ["2b_g64", "3b_g64", "4b_g64", "8b_g64"]
targets = [3.5, 4.5]
model, tok, _ = load("smollm2")
mixbits.patch(model)
toks = token_sequences(tok, load_texts(None, "auto"), 2 * n_seq, 256)
cal, held = toks[:n_seq], toks[n_seq:]
tmp = Path(__file__).parent / "results" / "smollm2" / "grad_tables"
tmp.mkdir(parents=True, exist_ok=True)
print(f"tables in {tmp}", flush=True)
ev = JointEvaluator(model, held, chunk=4)
out = {"what": f"SmolLM2-135M, all tensors x {len(cands)} candidates ({' '.join(cands)}), "
               f"calibration {n_seq} x 256 tokens, held out {n_seq} x 256, one run",
       "seconds": {}, "heldout_joint_kl": {f"{b}": {} for b in targets}}


def record(name, table, seconds, cpu_seconds):
    """Add one method's cost and the held-out joint KL of its allocations;
    print the whole record so far (a killed run keeps what it finished).
    Costs are compared in CPU seconds of this process (robust to other
    load on a shared machine); wall seconds are kept too."""
    out["seconds"][name] = round(seconds, 1)
    out.setdefault("cpu_seconds", {})[name] = round(cpu_seconds, 1)
    out["cost_vs_exact"] = {k: round(v / out["cpu_seconds"]["exact"], 4)
                            for k, v in out["cpu_seconds"].items()}
    for bpw in targets:
        alloc, _, _ = allocate_table(table, bpw)
        kl = ev.joint_kl({a["path"]: a["kind"] for a in alloc["assignment"]})[0]
        out["heldout_joint_kl"][f"{bpw}"][name] = round(kl, 5)
    if name == "two-stage":
        m = table["meta"]
        out["two_stage"] = {k: m[k] for k in ("exact_budget", "rounds", "exact_pairs", "exact_tensors",
                                              "exact_cost_share", "exact_seconds", "proxy_scales")}
    print(json.dumps(out, indent=1), flush=True)


t, c = time.perf_counter(), time.process_time()
table = sweep(model, cal, tmp / "exact.json", cands, progress=False)
record("exact", table, time.perf_counter() - t, time.process_time() - c)
t, c = time.perf_counter(), time.process_time()
table = proxy_sweep(model, cal, tmp / "grad.json", cands, method="grad", progress=False)
record("grad", table, time.perf_counter() - t, time.process_time() - c)
t, c = time.perf_counter(), time.process_time()
table = proxy_sweep(model, cal, tmp / "two.json", cands, method="two-stage", targets=targets,
                    budget=0.15, progress=False)
record("two-stage", table, time.perf_counter() - t, time.process_time() - c)
