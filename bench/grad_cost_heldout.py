"""Re-score the allocations of bench/grad_cost.py's three tables (exact,
grad, two-stage; it leaves them in its temporary directory) on 8 x 256
later held-out sequences: grad_cost.py's own held-out set is 1 x 256.

Run:  python bench/grad_cost_heldout.py TMPDIR
"""
import json
import sys

import mixbits
from mixbits.measure.calib import load_texts, token_sequences
from mixbits.measure.joint import JointEvaluator
from mixbits.measure.refine import allocate_table
from mixbits.models import load

d = sys.argv[1]
tables = {name: json.load(open(f"{d}/{file}"))
          for name, file in (("exact", "exact.json"), ("grad", "grad.json"), ("two-stage", "two.json"))}
model, tok, _ = load("smollm2")
mixbits.patch(model)
held = token_sequences(tok, load_texts(None, "auto"), 10, 256)[2:]  # after grad_cost's 2 x 256
ev = JointEvaluator(model, held, chunk=4)
for name, table in tables.items():
    kls = []
    for bpw in (3.5, 4.5):
        alloc, _, _ = allocate_table(table, bpw)
        kls.append(round(ev.joint_kl({a["path"]: a["kind"] for a in alloc["assignment"]})[0], 4))
    print(name, dict(zip(("3.5", "4.5"), kls)), flush=True)
