"""Sweep cost on SmolLM2-135M, in one run:

- ``ours``: the sensitivity engine (shared reference prefix, candidates
  batched through the suffix) on the patched model (mixbits linears,
  attention and SwiGLU);
- ``naive``: one full forward per candidate on the same patched model (the
  KL values must agree exactly: same kernels, same arithmetic);
- ``naive_stock``: one full forward per candidate on the model as loaded
  (MLX's quantized matmul, attention and activation): what a user without
  mixbits would run.

Run:  python bench/sweep_cost.py [N_SEQ] > bench/results/smollm2/sweep_cost.json
"""
import json
import sys
import time

import mixbits
from mixbits.measure.calib import load_texts, token_sequences
from mixbits.measure.candidates import parse_candidate
from mixbits.measure.model import LayeredModel
from mixbits.measure.sweep import Reference, SweepConfig, measure_site, measure_site_naive
from mixbits.models import load

n_seq = int(sys.argv[1]) if len(sys.argv) > 1 else 1
names = ["2b_g64", "3b_g64", "4b_g64", "8b_g64"]
cands = [parse_candidate(c) for c in names]
cfg = SweepConfig(names, max_batch=8)


def setup(patch: bool):
    model, tok, _ = load("smollm2")
    if patch:
        mixbits.patch(model)
    toks = token_sequences(tok, load_texts(None, "auto"), n_seq, 256)
    return LayeredModel(model), toks


lm, toks = setup(patch=True)
stock, _ = setup(patch=False)
chunk = min(n_seq, 8)
t = time.perf_counter()
ref = Reference(lm, toks, chunk)
t_ref = time.perf_counter() - t
stock_ref = Reference(stock, toks, chunk)
sites = [s for s in lm.sites() if s.layer in (0, 6, 12, 18, 24, 29) and s.kind in ("v_proj", "down_proj")]
ours = naive = naive_stock = 0.0
worst = worst_stock = 0.0
for s in sites:
    t = time.perf_counter()
    r = measure_site(lm, ref, s, cands, cfg)
    ours += time.perf_counter() - t
    for c in cands:
        t = time.perf_counter()
        k = measure_site_naive(lm, toks, s, c, cfg, ref.logits, chunk)
        naive += time.perf_counter() - t
        t = time.perf_counter()
        ks = measure_site_naive(stock, toks, s, c, cfg, stock_ref.logits, chunk)
        naive_stock += time.perf_counter() - t
        worst = max(worst, abs(k - r.kl[c.name]) / max(k, 1e-12))
        worst_stock = max(worst_stock, abs(ks - r.kl[c.name]) / max(ks, 1e-12))
n = len(sites) * len(cands)
print(json.dumps({
    "what": "12 tensors (v_proj, down_proj of layers 0,6,12,18,24,29) x 4 candidates "
            f"(2/3/4/8-bit g64), {n_seq} x 256 tokens, SmolLM2-135M, one run",
    "sites": len(sites), "candidate_evals": n, "tokens": int(toks.size),
    "reference_pass_s": round(t_ref, 2), "ours_s": round(ours, 2), "naive_s": round(naive, 2),
    "naive_stock_s": round(naive_stock, 2),
    "speedup_vs_naive": round(naive / ours, 2), "speedup_vs_naive_stock": round(naive_stock / ours, 2),
    "ours_candidate_tokens_per_s": round(n * toks.size / ours, 1),
    "naive_candidate_tokens_per_s": round(n * toks.size / naive, 1),
    "naive_stock_candidate_tokens_per_s": round(n * toks.size / naive_stock, 1),
    "max_rel_kl_diff_vs_naive": worst,
    "max_rel_kl_diff_vs_naive_stock": worst_stock,
}, indent=1))
