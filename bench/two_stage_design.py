"""Two-stage's decision rule simulated offline: from a saved exact table and
a saved grad table of the same calibration tokens (the exact sweep is
deterministic per tensor, so the exact pairs two-stage would measure are
copied from the exact table), build the table `proxy_sweep(method=
"two-stage")` would write at each BUDGET:ROUNDS, and score the allocations
(3.5 and 4.5 bpw) by joint KL on 8 x 256 design tokens: Botchan sequences
10..17, apart from grad_cost.py's (0: calibration, 1: held out) and
grad_cost_heldout.py's (every other sequence), which report the result.

Run:  python bench/two_stage_design.py EXACT.json GRAD.json 0.15:2 0.13:4 ...
(the tables: grad_cost.py's exact.json and grad.json, saved in
bench/results/smollm2/grad_tables/). Prints, per setting: share of pairs and of cost units measured,
joint KL and summed exact-table KL of each allocation, change vs exact.
"""
import json
import sys

import mixbits
from mixbits.measure import two_stage as ts
from mixbits.measure.calib import load_texts, token_sequences
from mixbits.measure.joint import JointEvaluator
from mixbits.measure.refine import allocate_table
from mixbits.models import load

TARGETS = (3.5, 4.5)
E, G = (json.load(open(p)) for p in sys.argv[1:3])
assert [e["path"] for e in E["entries"]] == [e["path"] for e in G["entries"]]
EX = {e["path"]: {c["kind"]: c["kl"] for c in e["candidates"]} for e in E["entries"]}


def simulate(budget: float, rounds: int):
    """proxy_sweep's exact stage with the exact table standing in for the
    measurements: (merged entries, measured pairs, cost units spent / total)."""
    entries, exact = G["entries"], {}
    cost = ts.pair_costs(entries)
    total = sum(cost[e["path"]] * len(e["candidates"]) for e in entries)
    spent = 0
    for r in range(rounds):
        for p, k in ts.plan(entries, exact, TARGETS, budget * total * (r + 1) / rounds - spent, cost):
            exact.setdefault(p, {})[k] = EX[p][k]
            spent += cost[p]
    return ts.merge(entries, exact), sum(map(len, exact.values())), spent / total


model, tok, _ = load("smollm2")
mixbits.patch(model)
ev = JointEvaluator(model, token_sequences(tok, load_texts(None, "auto"), 18, 256)[10:], chunk=4)
n_pairs = sum(len(e["candidates"]) for e in E["entries"])


def score(entries):
    out = []
    for bpw in TARGETS:
        alloc, _, _ = allocate_table({"entries": entries}, bpw)
        a = {x["path"]: x["kind"] for x in alloc["assignment"]}
        out.append((round(ev.joint_kl(a)[0], 4), round(sum(EX[p][k] for p, k in a.items()), 4)))
    return out


base = score(E["entries"])
print("exact (joint KL, summed table KL) at", TARGETS, base, flush=True)
print("grad", score(G["entries"]), flush=True)
for spec in sys.argv[3:]:
    b, r = spec.split(":")
    entries, n, units = simulate(float(b), int(r))
    s = score(entries)
    print(spec, f"pairs {n / n_pairs:.3f} units {units:.3f}", s,
          "joint vs exact", [f"{x[0] / y[0] - 1:+.4f}" for x, y in zip(s, base)], flush=True)
