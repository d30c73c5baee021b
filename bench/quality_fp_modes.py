"""SmolLM2-135M held-out KL at 4.25-4.5 bits per weight as stored: uniform
affine 4b_g64 (4.5), uniform mxfp4 (4.25), uniform
nvfp4 (4.5), and mixbits' allocation over the mixed menu (affine kinds and
MLX's fp modes) at 4.25 and 4.5 -- beside the same allocation over the
affine kinds alone, which shows what the fp modes add.

Sensitivities: the gradient proxy (``method="grad"``, two Fisher samples)
on calibration sequences 0-1 (256 tokens each) of the bundled Botchan
text; allocations: ``allocate_table`` (the exact optimum of the table's
summed KL under the budget), and ``refine`` (``mixbits refine``'s joint-KL
search from it on the calibration sequences, REFINE_EVALS evaluations, with
its uniform / mlx-lm-recipe guard). Scored on held-out
sequences 20-27 (none used for calibration, nor by bench/two_stage_design.py
which used 10-17): mean per-token KL of the quantized model against the
float model, per sequence, with the sequences' spread.

Run:  python bench/quality_fp_modes.py [TABLE.json]   (writes bench/results/fp_modes.json;
the grad table is kept in TABLE.json, default /tmp/fp_modes_table.json, and
reused when it exists)
"""
import hashlib
import json
import os
import warnings
import platform
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mixbits
from mixbits.measure.calib import load_texts, token_sequences
from mixbits.measure.joint import JointEvaluator
from mixbits.measure.refine import allocate_table, refine
from mixbits.measure.two_stage import proxy_sweep
from mixbits.models import load

OUT = Path(__file__).parent / "results" / "fp_modes.json"
SEQ, CAL, HELD = 256, range(0, 2), range(20, 28)
AFFINE = ["3b_g64", "3b_g128", "4b_g64", "4b_g128", "5b_g64", "6b_g64", "8b_g64"]
FP = ["mxfp4", "nvfp4", "mxfp8"]
UNIFORM = ["4b_g64", "mxfp4", "nvfp4"]  # (4b_g128 fits no K=576 tensor: not a uniform option)
TARGETS = (4.25, 4.5)
REFINE_EVALS = 6


def digest(a: dict) -> str:
    return hashlib.sha256(json.dumps(sorted(a.items())).encode()).hexdigest()[:16]


def host() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).parent).stdout.strip()
    return {"machine": platform.machine(), "cpu": cpu, "cores": os.cpu_count(),
            "loadavg_1m_start": os.getloadavg()[0], "mlx": mx.__version__,
            "mixbits": mixbits.__version__ if hasattr(mixbits, "__version__") else None, "commit": rev}


def storage_bpw(table: dict, assignment: dict) -> float:
    bits = nparams = 0
    for e in table["entries"]:
        c = next(c for c in e["candidates"] if c["kind"] == assignment[e["path"]])
        bits, nparams = bits + c["storage_bits"], nparams + e["nparams"]
    return bits / nparams


def only(table: dict, kinds) -> dict:
    """``table`` with each tensor's candidates restricted to ``kinds``."""
    return {**table, "entries": [{**e, "candidates": [c for c in e["candidates"] if c["kind"] in kinds]}
                                 for e in table["entries"]]}


if __name__ == "__main__":
    info = host()
    model, tok, _ = load("smollm2")
    mixbits.patch(model)
    text = load_texts(None, "auto")
    seqs = token_sequences(tok, text, max(HELD) + 1, SEQ)
    cal, held = seqs[list(CAL)], seqs[list(HELD)]
    t0 = time.perf_counter()
    table_path = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fp_modes_table.json")
    table = proxy_sweep(model, cal, table_path, AFFINE + FP, method="grad", progress=False,
                        resume=table_path.exists())  # a finished table with these settings is reused
    t_measure = table["meta"].get("proxy_seconds", time.perf_counter() - t0)
    print(f"grad table: {len(table['entries'])} tensors x {len(AFFINE + FP)} candidates in {t_measure:.0f} s",
          flush=True)
    paths = [e["path"] for e in table["entries"]]
    runs = {f"uniform {k}": {p: k for p in paths} for k in UNIFORM}
    cal_ev = JointEvaluator(model, cal, chunk=2)
    ev = JointEvaluator(model, held, chunk=2, calibration=cal_ev)
    extra, refine_seconds = {}, {}
    for bpw in TARGETS:
        for name, menu in (("mixed menu", AFFINE + FP), ("affine menu", AFFINE)):
            sub = only(table, menu)
            alloc = allocate_table(sub, bpw)[0]
            runs[f"mixbits {name} @{bpw}"] = {x["path"]: x["kind"] for x in alloc["assignment"]}
            t1 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ref = refine(sub, cal_ev, bpw, max_evals=REFINE_EVALS, progress=False)
            key = f"mixbits {name} @{bpw} +refine"
            runs[key] = {x["path"]: x["kind"] for x in ref["assignment"]}
            extra[key] = {"guard": ref.get("guard"), "warnings": [str(w.message)[:200] for w in caught]}
            refine_seconds[key] = round(time.perf_counter() - t1, 1)
            print(f"{key}: refined in {refine_seconds[key]:.0f} s", flush=True)
    # Held-out scores of an earlier run of this script, by assignment: each scored once.
    old = json.loads(OUT.read_text()).get("results", {}) if OUT.exists() else {}
    old = {v["assignment_digest"]: v for v in old.values() if "assignment_digest" in v}
    results = {}
    for name, a in runs.items():
        t1 = time.perf_counter()
        h = digest(a)
        kls = np.array(old[h]["kl_per_sequence"]) if h in old else ev.sequence_kls(a)
        counts = {}
        for k in a.values():
            counts[k] = counts.get(k, 0) + 1
        results[name] = {"storage_bpw": round(storage_bpw(table, a), 4), "kl_mean": round(float(kls.mean()), 5),
                         "kl_per_sequence": [round(float(v), 5) for v in kls], "assignment_digest": h,
                         "kinds_chosen": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
                         **extra.get(name, {})}
        print(f"{name:32s} {results[name]['storage_bpw']:.3f} bpw  held-out KL {kls.mean():.5f}  "
              f"({time.perf_counter() - t1:.0f} s)", flush=True)
    info["loadavg_1m_end"] = os.getloadavg()[0]
    out = {"what": "SmolLM2-135M (mixbits.load('smollm2')) held-out KL vs the float model: mean per-token KL "
                   f"over {len(HELD)} held-out Botchan sequences of {SEQ} tokens ({HELD.start}..{HELD.stop - 1}); "
                   "mixbits allocations = allocate_table on a grad-proxy table from sequences "
                   f"{CAL.start}..{CAL.stop - 1}, and refine (joint KL on those sequences, "
                   f"{REFINE_EVALS} evaluations + guard: '+refine'); storage_bpw counts codes, scales, "
                   "biases as stored (4b_g64 4.5, 4b_g128 4.25, mxfp4 4.25, nvfp4 4.5, mxfp8 8.25)",
           "host": info, "menu": {"affine": AFFINE, "fp": FP}, "measure_seconds": round(t_measure, 1),
           "refine_seconds": refine_seconds,
           "results": results}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT}")
