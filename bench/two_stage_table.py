"""One two-stage table with the current rule on grad_cost.py 1's calibration
(Botchan sequence 0, 256 tokens, 2b/3b/4b/8b g64, targets 3.5 and 4.5), saved
in bench/results/smollm2/grad_tables/NAME.json, with its CPU seconds; score it
with bench/grad_cost_heldout.py exact=.../exact.json NAME=.../NAME.json.

Run:  python bench/two_stage_table.py NAME [BUDGET [ROUNDS]]
"""
import json
import sys
import time
from pathlib import Path

import mixbits
from mixbits.measure.calib import load_texts, token_sequences
from mixbits.measure.two_stage import ROUNDS, proxy_sweep
from mixbits.models import load

name = sys.argv[1]
budget = float(sys.argv[2]) if len(sys.argv) > 2 else 0.15
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else ROUNDS
model, tok, _ = load("smollm2")
mixbits.patch(model)
cal = token_sequences(tok, load_texts(None, "auto"), 2, 256)[:1]
out = Path(__file__).parent / "results" / "smollm2" / "grad_tables" / f"{name}.json"
t, c = time.perf_counter(), time.process_time()
table = proxy_sweep(model, cal, out, ["2b_g64", "3b_g64", "4b_g64", "8b_g64"], method="two-stage",
                    targets=[3.5, 4.5], budget=budget, rounds=rounds, progress=False)
m = table["meta"]
print(json.dumps({"table": str(out), "seconds": round(time.perf_counter() - t, 1),
                  "cpu_seconds": round(time.process_time() - c, 1),
                  **{k: m[k] for k in ("exact_budget", "rounds", "exact_pairs", "exact_tensors",
                                       "exact_cost_share", "exact_seconds", "proxy_scales")}}, indent=1))
