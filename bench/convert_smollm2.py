"""`mixbits convert` on SmolLM2-135M at 3.5 and 4.5 storage bpw: wall and
CPU time, and held-out KL against mlx-lm's contenders at the same storage
bpw over the same tensors.

Calibration: convert's defaults (8 x 256 tokens of the built-in Botchan
text). Held out: 8 x 256 tokens of another text (the license texts under
/usr/share/common-licenses), never used for any choice. Contenders, each
scored as the mean per-token KL of the final logits against the
unquantized model on the held-out tokens:
- mlx_lm.convert -q at 3 / 4 bits g64 (uniform: 3.5 / 4.5 bpw as stored);
- mlx-lm's mixed recipes (mixed_3_4 ... ) where one fits the budget;
- mlx-lm's dynamic_quant (its own estimate_sensitivities, on the same
  calibration tokens; widths 2/4 at 3.5, 3/8 at 4.5, threshold set at the
  same storage bpw). Its float twin's linears run on mixbits' float GEMM
  (mixbits.patch; gradients checked against MLX's in tests/test_float_linear.py):
  MLX's Linux CPU matmul took ~25 min per 4 x 256-token batch here;
- the folder `mixbits convert` wrote, loaded with mixbits.load.
Paired ratio (mixbits / contender) over the 8 held-out sequences, with a
bootstrap 95% interval.

Superseded for quality claims by bench/quality_protocol.py (more budgets,
seeds, two held-out sets, every contender); kept for its stage timings.

Run:  python bench/convert_smollm2.py [--threads N] [--work DIR]  (about
15 min on two unloaded Zen 4 cores). Rerun with the same --work after a
kill: convert continues from its kept stages, and the per-stage times in
the result (from DIR/smollm2.work/timings.json) sum over the runs. Writes
bench/results/convert_smollm2.json.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

# one evaluation protocol: the host record and the paired bootstrap live there
from quality_protocol import host, ratio_ci

RESULT = Path(__file__).parent / "results" / "convert_smollm2.json"
# target bpw -> (mlx_lm.convert -q kind, dynamic_quant's widths). dynamic_quant
# with adjacent widths (3/4 at 3.5, 4/5 at 4.5) can upgrade nothing at these
# budgets and is the uniform row; the wider pairs are its real alternative.
TARGETS = {3.5: ("3b_g64", ("2b_g64", "4b_g64")), 4.5: ("4b_g64", ("3b_g64", "8b_g64"))}
HELD_N, HELD_T = 8, 256


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None, help="MIXBITS_NUM_THREADS for convert")
    ap.add_argument("--work", default=None, help="keep the converted folders here (default: a temp dir)")
    ap.add_argument("--targets", type=float, nargs="+", default=list(TARGETS), choices=list(TARGETS))
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="convert_smollm2_"))
    out = work / "smollm2"
    env = dict(os.environ)
    if args.threads:
        env["MIXBITS_NUM_THREADS"] = str(args.threads)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "mixbits.cli", "convert", "--model", "smollm2",
           "--bpw", *map(str, TARGETS), "--out", str(out)]  # one measurement for every target
    subprocess.run(cmd, env=env, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"convert: {wall:.1f} s wall, {cpu:.1f} CPU s", flush=True)

    import mixbits
    from mixbits.measure.baselines import baselines, entry_bpw, mixed_rule, uniform
    from mixbits.measure.calib import cast_model, load_texts, token_sequences
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities

    from mixbits.measure.dynamic_quant import assignment as dq_assignment, float_copy
    from mixbits.measure.joint import JointEvaluator
    from mixbits.nn import patch

    model, tok, _ = mixbits.load("smollm2")
    cast_model(model, "float32")
    patch(model)
    held = token_sequences(tok, load_texts(None, "licenses"), HELD_N, HELD_T)
    calib = np.load(Path(str(out) + ".work") / "tokens.npy")
    table = json.loads((Path(str(out) + ".work") / "table.json").read_text())
    ev = JointEvaluator(model, held, chunk=2)
    ref = ev.ref_logits  # the unquantized model's logits, per chunk of held-out sequences

    def seq_kls_of_model(m) -> np.ndarray:
        from mixbits.measure.sweep import kl_per_token

        rows = []
        for i, r in zip(range(0, HELD_N, ev.chunk), ref):
            logits = m(mx.array(held[i:i + ev.chunk])).astype(mx.float32)
            rows.append(np.asarray(kl_per_token(r, logits)).mean(axis=1))
        return np.concatenate(rows)

    rows = json.loads(RESULT.read_text())["rows"] if RESULT.exists() else []
    rows = [r for r in rows if r["target_bpw"] not in args.targets]
    for bpw in args.targets:
        uni, (dq_lo, dq_hi) = TARGETS[bpw]
        alloc = json.loads((out / f"{bpw:g}bpw" / "allocation.json").read_text())
        ours_assign = {a["path"]: a["kind"] for a in alloc["assignment"]}
        folder_model, _, _ = mixbits.load(out / f"{bpw:g}bpw")
        ours = seq_kls_of_model(folder_model)
        del folder_model
        # the folder holds what the allocation says (the same layers the evaluator builds)
        check = ev.sequence_kls(ours_assign)
        contenders = {f"mlx_lm.convert -q {uni} (uniform)": uniform(table, uni)}
        for name, plan, b in baselines(table, ev.adapter, bpw):
            if name.startswith("mlx-lm mixed"):
                contenders[name] = plan
        twin = float_copy(model)
        patch(twin)  # float linears on mixbits' float GEMM: same function, same gradients
        sens = dict(estimate_sensitivities(twin, mx.array(calib), int(dq_lo[0]), 64, int(dq_hi[0]), 64,
                                           batch_size=4))
        del twin
        contenders[f"mlx-lm dynamic_quant {dq_lo}/{dq_hi}"] = dq_assignment(table, sens, bpw, dq_lo, dq_hi)
        row = {"target_bpw": bpw, "mixbits": {"bpw": alloc["average_bpw_storage"],
                                              "written": alloc["guard"]["written"],
                                              "heldout_kl": float(ours.mean()),
                                              "heldout_kl_se": float(ours.std(ddof=1) / np.sqrt(HELD_N)),
                                              "folder_vs_assignment_max_abs": float(np.abs(ours - check).max())},
               "contenders": []}
        for name, plan in contenders.items():
            k = ev.sequence_kls(plan)
            row["contenders"].append({"name": name, "bpw": entry_bpw(table, plan),
                                      "heldout_kl": float(k.mean()),
                                      "heldout_kl_se": float(k.std(ddof=1) / np.sqrt(HELD_N)),
                                      "ratio": float(ours.mean() / k.mean()),
                                      "ratio_ci95": ratio_ci(ours, k)[1]})
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
        rows.sort(key=lambda r: r["target_bpw"])
    stages = json.loads((Path(str(out) + ".work") / "timings.json").read_text())
    RESULT.write_text(json.dumps({"host": host(), "command": " ".join(cmd[2:]), "threads": args.threads,
                                  "convert_wall_s_this_run": round(wall, 1),
                                  "convert_cpu_s_this_run": round(cpu, 1),
                                  "stage_wall_s_all_runs": stages,
                                  "calibration": list(calib.shape), "heldout": [HELD_N, HELD_T],
                                  "heldout_text": "licenses", "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
