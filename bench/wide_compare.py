"""SmolLM2-135M, the wide candidate set: our allocations against uniform,
mlx-lm's mixed_* recipes and mlx-lm's dynamic_quant, all at equal storage
bpw, scored by joint KL of the final logits on held-out sequences.

Run:  python bench/wide_compare.py [N_CAL] [N_HELD] > bench/results/smollm2/wide/log.txt
(the committed run: 16 4; default 16 x 256 calibration tokens, 8 x 256 held out; writes
bench/results/smollm2/wide/{table.json,result.json} and prints the record
after every step, so a killed run keeps what it finished)

Our table: ``--method grad`` (the diagonal-Fisher proxy; an exact sweep of
19 candidates x 211 tensors on 4,096 tokens is ~4 CPU hours here). Ours =
the knapsack optimum on it ("dp") and that optimum refined by swaps kept
only when they lower the measured joint KL on 4 calibration sequences
("refined", at the targets). Baselines get the same model, tokens and evaluator:
- uniform: every tensor at one candidate (the table's widths at g64/g128);
- mlx-lm's mixed_2_6 / mixed_3_4 / mixed_3_6 / mixed_4_6 recipes (its rule:
  v_proj, down_proj of the first and last eighth of the blocks and of
  every third block between, and the head, at the high width);
- mlx-lm's dynamic_quant: its own gradient sensitivities
  (mlx_lm.quant.dynamic_quant.estimate_sensitivities) on our calibration
  tokens (its procedure differentiates a float copy through MLX's CPU
  matmul, ~200 s per sequence and width pair here, so it gets the first 2
  calibration sequences), for the width pairs whose range holds the
  target; best pair reported.
At every recipe's bpw (DP only) and every target (DP and refined, 4
joint-KL evaluations), ours is allocated at that bpw.
"""
import json
import sys
import time
from pathlib import Path


import mixbits
from mixbits.adapter import ModelAdapter
from mixbits.measure.calib import load_texts, token_sequences
from mixbits.measure.candidates import expand_candidates, parse_candidate
from mixbits.measure.compare import entry_bpw, mixed_rule, uniform
from mixbits.measure.dynamic_quant import assignment as dq_assignment
from mixbits.measure.dynamic_quant import sensitivities
from mixbits.measure.joint import JointEvaluator
from mixbits.measure.refine import allocate_table, refine
from mixbits.models import load

import grad_table  # bench/grad_table.py

n_cal = int(sys.argv[1]) if len(sys.argv) > 1 else 16
n_held = int(sys.argv[2]) if len(sys.argv) > 2 else 8
TARGETS = [3.0, 3.5, 3.625, 4.0, 4.5, 4.76]
RECIPES = [("2b_g64", "6b_g64"), ("3b_g64", "4b_g64"), ("3b_g64", "6b_g64"), ("4b_g64", "6b_g64")]
DQ_PAIRS = [("2b_g64", "3b_g64"), ("3b_g64", "4b_g64"), ("4b_g64", "6b_g64")]
N_DQ = 2
MAX_EVALS = 4  # joint-KL evaluations per refined target (each: 4 x 256 tokens)
out_dir = Path(sys.argv[3] if len(sys.argv) > 3 else "bench/results/smollm2/wide")
out_dir.mkdir(parents=True, exist_ok=True)

model, tok, _ = load("smollm2")
mixbits.patch(model)
toks = token_sequences(tok, load_texts(None, "auto"), n_cal + n_held, 256)
cal, held = toks[:n_cal], toks[n_cal:]
# The wide preset (g64 and g128; SmolLM2's K = 576 takes g128 only in
# down_proj) plus g32 at 2-4 bits, which every tensor here takes.
cands = expand_candidates(["wide", "2b_g32", "3b_g32", "4b_g32"])
rec = {"what": f"SmolLM2-135M, {len(cands)} candidates ({' '.join(cands)}), table by --method grad "
               f"on {n_cal} x 256 tokens; joint KL on {n_held} x 256 held-out tokens",
       "seconds": {}, "rows": []}


def dump():
    grad_table.dump(rec, out_dir)


table, rec["seconds"]["table"] = grad_table.grad_table(model, cal, cands, out_dir)
dump()

adapter = ModelAdapter(model)
ev_cal = JointEvaluator(model, cal[:4], chunk=4)
ev_held = JointEvaluator(model, held, chunk=4)


def held_kl(assign):
    return round(ev_held.joint_kl(assign)[0], 5)


def ours(bpw, refine_evals=MAX_EVALS):
    alloc, _, _ = allocate_table(table, bpw)
    dp = {a["path"]: a["kind"] for a in alloc["assignment"]}
    row = {"dp": {"bpw": round(entry_bpw(table, dp), 4), "heldout_kl": held_kl(dp)}}
    if refine_evals:
        ref = refine(table, ev_cal, bpw, max_evals=refine_evals, progress=False)
        refined = {a["path"]: a["kind"] for a in ref["assignment"]}
        row["refined"] = {"bpw": round(entry_bpw(table, refined), 4),
                          "heldout_kl": held_kl(refined), "swaps": ref["joint_refine"]["swaps"],
                          "evaluations": ref["joint_refine"]["evaluations"]}
    return row


t = time.perf_counter()
sens_path = out_dir / "dynamic_quant_sensitivities.json"
dq_sens = json.loads(sens_path.read_text()) if sens_path.exists() else {}
for lo, hi in DQ_PAIRS:
    if f"{lo}/{hi}" in dq_sens:
        continue
    (lb, lg), (hb, hg) = ((c.bits, c.group_size) for c in map(parse_candidate, (lo, hi)))
    # mlx-lm's own procedure differentiates a float copy through MLX's CPU
    # matmul (~200 s per sequence per pair here): N_DQ sequences.
    dq_sens[f"{lo}/{hi}"] = sensitivities(model, cal[:N_DQ], (lb, lg), (hb, hg))
    sens_path.write_text(json.dumps(dq_sens))
rec["seconds"]["dynamic_quant_sensitivities"] = round(time.perf_counter() - t, 1)
rec["dynamic_quant_sequences"] = N_DQ
dump()

everywhere = [n for n in cands if parse_candidate(n).kind == "uniform" and all(
    n in {c["kind"] for c in e["candidates"]} for e in table["entries"])]
uniforms = {n: entry_bpw(table, uniform(table, n)) for n in everywhere}
rec["uniform"] = {n: {"bpw": round(b, 4), "heldout_kl": held_kl(uniform(table, n))}
                  for n, b in sorted(uniforms.items(), key=lambda kv: kv[1]) if 2.9 <= b <= 5.3}
dump()

t = time.perf_counter()
for lo, hi in RECIPES:
    rule = mixed_rule(table, lo, hi, adapter)
    bpw = entry_bpw(table, rule)
    row = {"target_bpw": round(bpw, 4), "baseline": f"mlx-lm mixed_{parse_candidate(lo).bits}_{parse_candidate(hi).bits}",
           "baseline_heldout_kl": held_kl(rule), **ours(bpw, refine_evals=0)}
    rec["rows"].append(row)
    dump()
for bpw in TARGETS:
    row = {"target_bpw": bpw, **ours(bpw)}
    best = None
    for pair, sens in dq_sens.items():
        lo, hi = pair.split("/")
        lo_b, hi_b = uniforms.get(lo), uniforms.get(hi)
        if lo_b is None or hi_b is None or not lo_b <= bpw <= hi_b:
            continue
        dq = dq_assignment(table, sens, bpw, lo, hi)
        kl = held_kl(dq)
        row.setdefault("dynamic_quant", []).append(
            {"pair": f"{lo}/{hi}", "bpw": round(entry_bpw(table, dq), 4), "heldout_kl": kl})
        best = kl if best is None else min(best, kl)
    row["dynamic_quant_best"] = best
    rec["rows"].append(row)
    dump()
rec["seconds"]["allocations_and_evaluations"] = round(time.perf_counter() - t, 1)
dump()
