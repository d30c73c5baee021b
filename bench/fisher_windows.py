"""How much each calibration window puts into the gradient proxy's Fisher
diagonal, with and without the per-position clip (grad.POSITION_CLIP).

One window at a time, one sample, the protocol's calibration windows
(bench/quality_protocol.token_sets): each named tensor's Fisher total
(sum of the diagonal) and, per window, the largest ratio of a position's
output-gradient norm to the window's median (over the named tensors). A
window whose first tokens act as the model's attention sink can put
thousands of times an ordinary window's weight on a tensor without a
larger true KL (Gemma-3-270M, seed 1, window 6; bench/README), which the
clip is for. Not a timing.

Run:  python bench/fisher_windows.py --model gemma3 --seeds 0 1 \\
        --out bench/results/fisher_windows_gemma3.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from quality_protocol import host, token_sets  # noqa: E402

TENSORS = ("model.embed_tokens", "model.layers.0.self_attn.v_proj", "model.layers.8.mlp.down_proj")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--tensors", nargs="+", default=list(TENSORS))
    ap.add_argument("--clips", type=float, nargs="+", default=[math.inf, 100.0, 30.0],
                    help="per-position clips to compare (inf: none)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    import mixbits
    from mixbits.adapter import ModelAdapter
    from mixbits.measure import grad
    from mixbits.measure.calib import cast_model
    from mixbits.nn import patch

    model, tok, _ = mixbits.load(a.model)
    cast_model(model, "float32")
    patch(model)
    sites = [s for s in ModelAdapter(model).sites if s.path in a.tensors]
    missing = set(a.tensors) - {s.path for s in sites}
    if missing:
        raise SystemExit(f"{a.model} has no tensor(s) {sorted(missing)}")
    calib, _ = token_sets(tok, a.seeds)

    ratios: dict = {}
    real = grad.accumulate_fisher

    def watch(fisher, inputs, grads, forms, n_seq, out_energy):
        # the largest position/median ratio of this window, before any clip
        for d in grads.values():
            rows = np.array(d.astype(mx.float32)).reshape(-1, d.shape[-1]).astype(np.float64)
            n = np.sqrt((rows * rows).sum(-1))
            ratios["max"] = max(ratios.get("max", 0.0), float(n.max() / np.median(n)))
        real(fisher, inputs, grads, forms, n_seq, out_energy)

    grad.accumulate_fisher = watch
    default = grad.POSITION_CLIP
    rows = []
    t0 = time.perf_counter()
    try:
        for seed in a.seeds:
            for w in range(len(calib[seed])):
                row = {"seed": seed, "window": w, "first_ids": calib[seed][w, :4].tolist(), "totals": {}}
                for clip in a.clips:
                    grad.POSITION_CLIP = clip
                    ratios.clear()
                    f, _ = grad.fisher_diagonal(model, calib[seed][w : w + 1], sites, progress=False)
                    row["totals"][str(clip)] = {p: float(np.sum(v, dtype=np.float64)) for p, v in f.items()}
                    row["max_position_ratio"] = round(ratios["max"], 1)
                rows.append(row)
                print(seed, w, row["max_position_ratio"],
                      {c: {p.split(".")[-1]: f"{v:.3g}" for p, v in t.items()} for c, t in row["totals"].items()},
                      flush=True)
    finally:
        grad.POSITION_CLIP = default
        grad.accumulate_fisher = real
    out = {"model": a.model, "tensors": a.tensors, "clips": a.clips, "samples": 1,
           "host": host(), "seconds": round(time.perf_counter() - t0, 1), "windows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(a.out)


if __name__ == "__main__":
    main()
