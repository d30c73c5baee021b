"""SmolLM2-135M: allocations with calibrated candidates in the sweep
against the RTN-only allocation, at equal storage bpw, scored by joint KL
of the final logits on held-out sequences.

Run:  nice -n 5 python bench/calibrated_alloc.py [N_CAL] [N_HELD] > bench/results/smollm2/calibrated/log.txt
(the committed run: 16 8; writes bench/results/smollm2/calibrated/{table.json,result.json},
the record printed after every step, so a killed run keeps what it finished)

One table by ``--method grad`` on the N_CAL x 256 calibration tokens with
RTN candidates (2/3/4/5/6/8 bits, g64) and the same widths' ``+gptq``
(2-5 bits): GPTQ error feedback, group parameters by search, fitted on
those tokens' X^T X. The RTN allocation is the knapsack optimum on the
table's RTN rows only, the calibrated one on all rows; both are then
refined by joint-KL swaps (4 evaluations on 4 calibration sequences).
Held-out scoring fits every calibrated layer on the calibration tokens
(``JointEvaluator(calibration=)``), never on the held-out ones.
"""
import sys
import time
from pathlib import Path

import numpy as np

import mixbits
from mixbits.measure.calib import load_texts, token_sequences
from mixbits.measure.compare import entry_bpw
from mixbits.measure.joint import JointEvaluator
from mixbits.measure.refine import allocate_table, refine
from mixbits.models import load

import grad_table  # bench/grad_table.py

n_cal = int(sys.argv[1]) if len(sys.argv) > 1 else 16
n_held = int(sys.argv[2]) if len(sys.argv) > 2 else 8
TARGETS = [3.0, 3.5, 4.5]
MAX_EVALS = 4
RTN = ["2b_g64", "3b_g64", "4b_g64", "5b_g64", "6b_g64", "8b_g64"]
CALIBRATED = ["2b_g64+gptq", "3b_g64+gptq", "4b_g64+gptq", "5b_g64+gptq"]
out_dir = Path("bench/results/smollm2/calibrated")
out_dir.mkdir(parents=True, exist_ok=True)

model, tok, _ = load("smollm2")
mixbits.patch(model)
toks = np.asarray(token_sequences(tok, load_texts(None, "auto"), n_cal + n_held, 256))
cal, held = toks[:n_cal], toks[n_cal:]
rec = {"what": f"SmolLM2-135M, table by --method grad on {n_cal} x 256 calibration tokens with "
               f"{' '.join(RTN + CALIBRATED)}; joint KL on {n_held} x 256 held-out tokens "
               "(calibrated layers fitted on the calibration tokens)",
       "command": f"nice -n 5 python bench/calibrated_alloc.py {n_cal} {n_held}",
       "seconds": {}, "rows": []}


def dump():
    grad_table.dump(rec, out_dir)


table, rec["seconds"]["table"] = grad_table.grad_table(model, cal, RTN + CALIBRATED, out_dir)
dump()


def only(names):
    """The table restricted to candidates ``names`` (same measurements)."""
    return {**table, "entries": [{**e, "candidates": [c for c in e["candidates"] if c["kind"] in names]}
                                 for e in table["entries"]]}


rtn_table = only(set(RTN))
ev_cal = JointEvaluator(model, cal, chunk=4)  # X^T X of the whole calibration set
ev_refine = JointEvaluator(model, cal[:4], chunk=4, calibration=ev_cal)
ev_held = JointEvaluator(model, held, chunk=4, calibration=ev_cal)


def held_kl(assign):
    m, se = ev_held.joint_kl(assign)
    return {"heldout_kl": round(m, 5), "kl_se": round(se, 5)}


def allocations(tab, bpw):
    alloc, _, _ = allocate_table(tab, bpw)
    dp = {a["path"]: a["kind"] for a in alloc["assignment"]}
    ref = refine(tab, ev_refine, bpw, max_evals=MAX_EVALS, progress=False)
    refined = {a["path"]: a["kind"] for a in ref["assignment"]}
    out = {}
    for name, a in (("dp", dp), ("refined", refined)):
        kinds = [k for k in a.values()]
        out[name] = {"bpw": round(entry_bpw(tab, a), 4), **held_kl(a),
                     "calibrated_tensors": sum("+" in k for k in kinds),
                     "widths": {b: sum(k.startswith(b) for k in kinds) for b in "234568"}}
    out["refined"]["swaps"] = ref["joint_refine"]["swaps"]
    return out


t = time.perf_counter()
for bpw in TARGETS:
    row = {"target_bpw": bpw, "rtn": allocations(rtn_table, bpw), "calibrated": allocations(table, bpw)}
    for k in ("dp", "refined"):
        row[f"ratio_{k}"] = round(row["calibrated"][k]["heldout_kl"] / row["rtn"][k]["heldout_kl"], 3)
    rec["rows"].append(row)
    rec["seconds"]["allocations_and_evaluations"] = round(time.perf_counter() - t, 1)
    dump()
