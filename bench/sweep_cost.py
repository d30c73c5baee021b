"""Sweep cost: the sensitivity engine (shared reference prefix, candidates
batched through the suffix) against one full forward per candidate, in the
same run, on SmolLM2-135M. Checks the KL values agree. Run:
    python bench/sweep_cost.py > bench/results/smollm2/sweep_cost.json
"""
import time, json, mixbits
from mixbits.models import load
from mixbits.measure.calib import load_texts, token_sequences
from mixbits.measure.model import LayeredModel
from mixbits.measure.sweep import Reference, SweepConfig, measure_site, measure_site_naive
from mixbits.measure.candidates import parse_candidate
model, tok, _ = load("smollm2"); mixbits.patch(model)
toks = token_sequences(tok, load_texts(None, "auto"), 1, 256)
lm = LayeredModel(model)
names = ["2b_g64", "3b_g64", "4b_g64", "8b_g64"]
cands = [parse_candidate(c) for c in names]; cfg = SweepConfig(names, max_batch=4)
t = time.perf_counter(); ref = Reference(lm, toks, 1); t_ref = time.perf_counter() - t
sites = [s for s in lm.sites() if s.layer in (0, 6, 12, 18, 24, 29) and s.kind in ("v_proj", "down_proj")]
ours = naive = 0.0; worst = 0.0
for s in sites:
    t = time.perf_counter(); r = measure_site(lm, ref, s, cands, cfg); ours += time.perf_counter() - t
    for c in cands:
        t = time.perf_counter(); k = measure_site_naive(lm, toks, s, c, cfg, ref.logits, 1); naive += time.perf_counter() - t
        worst = max(worst, abs(k - r.kl[c.name]) / max(k, 1e-12))
n = len(sites) * len(cands)
print(json.dumps({"sites": len(sites), "candidate_evals": n, "tokens": int(toks.size),
  "reference_pass_s": round(t_ref, 2), "ours_s": round(ours, 2), "naive_s": round(naive, 2),
  "speedup": round(naive / ours, 2), "ours_tokens_per_s": round(n * toks.size / ours, 1),
  "naive_tokens_per_s": round(n * toks.size / naive, 1), "max_rel_kl_diff": worst}, indent=1))
