"""Re-score the allocations of bench/grad_cost.py's tables (exact, grad,
two-stage; saved in bench/results/smollm2/grad_tables/) at 3.5 and 4.5 bpw
on every held-out 256-token Botchan sequence, one joint KL per sequence,
and give paired bootstrap 95% intervals of (method / exact - 1) over
sequences.

Held out: every whole 256-token sequence of the bundled Botchan text
except 0 (grad_cost.py 1's calibration) and 10..17 (the design tokens of
bench/two_stage_design.py, on which two-stage's rule was chosen).

Run:  python bench/grad_cost_heldout.py [NAME=TABLE.json ...] > OUT.log
(default: exact, grad, two-stage from grad_tables/; the first is the
reference). Writes bench/results/smollm2/grad_heldout_seqs.json; an
allocation already scored there (same digest, same sequences) is reused.
"""
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

import mixbits
from mixbits.measure.calib import load_texts, token_sequences
from mixbits.measure.joint import JointEvaluator
from mixbits.measure.refine import allocate_table
from mixbits.models import load

RES = Path(__file__).parent / "results" / "smollm2"
TARGETS = (3.5, 4.5)
SEQ, CAL, DESIGN = 256, 1, range(10, 18)
BLOCK = 16  # sequences per evaluator: their reference logits are 16 x 256 x 49152 float32
RESAMPLES, SEED = 10_000, 0
OUT = RES / "grad_heldout_seqs.json"


def digest(assignment: dict) -> str:
    return hashlib.sha256(json.dumps(sorted(assignment.items())).encode()).hexdigest()[:16]


def paired_bootstrap(x: np.ndarray, ref: np.ndarray) -> tuple[float, float, float]:
    """(point, 2.5%, 97.5%) of mean(x) / mean(ref) - 1 over sequences
    resampled in pairs (the same sequences for both)."""
    idx = np.random.default_rng(SEED).integers(0, len(x), (RESAMPLES, len(x)))
    r = x[idx].mean(axis=1) / ref[idx].mean(axis=1) - 1
    lo, hi = np.percentile(r, [2.5, 97.5])
    return float(x.mean() / ref.mean() - 1), float(lo), float(hi)


def verdict(lo: float, hi: float, goal: float = 0.02) -> str:
    return "met" if hi <= goal else "missed" if lo > goal else "not distinguishable from 2%"


if __name__ == "__main__":
    specs = sys.argv[1:] or [f"exact={RES}/grad_tables/exact.json", f"grad={RES}/grad_tables/grad.json",
                             f"two-stage={RES}/grad_tables/two.json"]
    tables = {s.split("=", 1)[0]: json.load(open(s.split("=", 1)[1])) for s in specs}
    model, tok, _ = load("smollm2")
    mixbits.patch(model)
    text = load_texts(None, "auto")
    n_all = len(tok.encode(text)) // SEQ
    held = [i for i in range(CAL, n_all) if i not in DESIGN]
    toks = token_sequences(tok, text, n_all, SEQ)[held]
    allocs = {(name, bpw): {a["path"]: a["kind"] for a in allocate_table(t, bpw)[0]["assignment"]}
              for name, t in tables.items() for bpw in TARGETS}
    print(f"{n_all} sequences of {SEQ} tokens in the corpus; {len(held)} held out", flush=True)
    digests = {key: digest(a) for key, a in allocs.items()}
    saved = json.loads(OUT.read_text()) if OUT.exists() else {}
    saved = saved.get("by_digest", {}) if saved.get("held_out_sequences") == held else {}
    todo = {h: allocs[key] for key, h in digests.items() if h not in saved}  # each allocation once
    print(f"{len(todo)} allocations to score, {len(set(digests.values())) - len(todo)} reused", flush=True)
    got = {h: [] for h in todo}
    c0, first = time.process_time(), None
    for b in range(0, len(toks), BLOCK) if todo else ():
        ev = JointEvaluator(model, toks[b:b + BLOCK], chunk=4, calibration=first)  # shares the layer cache
        first = first or ev
        for h, a in todo.items():
            got[h] += ev.sequence_kls(a).tolist()
        print(f"{b + len(toks[b:b + BLOCK])} / {len(toks)} sequences, "
              f"{time.process_time() - c0:.0f} CPU s", flush=True)
    by_digest = {**saved, **{h: [round(v, 6) for v in vs] for h, vs in got.items()}}
    kls = {key: by_digest[h] for key, h in digests.items()}
    ref = next(iter(tables))
    out = {"what": f"joint KL per held-out sequence ({SEQ} tokens) of each table's allocation "
                   f"(allocate_table, no refinement); paired bootstrap over sequences, {RESAMPLES} "
                   f"resamples, seed {SEED}, percentile 95% interval",
           "corpus": f"Botchan (mixbits.models.calibration_text('auto')), {n_all} whole sequences; "
                     f"held out: all but 0..{CAL - 1} (calibration) and {DESIGN.start}..{DESIGN.stop - 1} (design)",
           "held_out_sequences": held, "tables": specs, "cpu_seconds_this_call": round(time.process_time() - c0, 1),
           "allocation_digest": {f"{n} {b}": h for (n, b), h in digests.items()},
           "joint_kl": {}, "vs_" + ref: {}}
    for bpw in TARGETS:
        e = np.array(kls[(ref, bpw)])
        out["joint_kl"][f"{bpw}"] = {n: round(float(np.mean(kls[(n, bpw)])), 5) for n in tables}
        out["vs_" + ref][f"{bpw}"] = {}
        for n in tables:
            if n == ref:
                continue
            p, lo, hi = paired_bootstrap(np.array(kls[(n, bpw)]), e)
            out["vs_" + ref][f"{bpw}"][n] = {"point": round(p, 4), "ci95": [round(lo, 4), round(hi, 4)],
                                             "within_2pct": verdict(lo, hi)}
    out["by_digest"] = by_digest  # joint KL per held-out sequence of each allocation scored so far
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k not in ("by_digest", "held_out_sequences")},
                     indent=1), flush=True)
