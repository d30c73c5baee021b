"""Sweep cost, in one run, on a real model or a random-weight hybrid:

- ``ours``: the sensitivity engine (recorded reference prefix replayed,
  candidates batched through the suffix, all through the model's own
  forward) on the patched model (mixbits linears, attention, SwiGLU);
- ``naive``: one full ``model(tokens)`` per candidate on the same patched
  model (KL values must agree: same kernels, same arithmetic);
- ``naive_stock`` (``--stock``, slow): the same on the model as loaded
  (MLX's quantized matmul, attention and activation).

Run:
  python bench/sweep_cost.py --model smollm2 > bench/results/smollm2/sweep_cost.json
  python bench/sweep_cost.py --model tiny:qwen3_next > bench/results/sweep_cost_qwen3_next.json
``tiny:<arch>`` builds tests/tiny_models.py's architecture at a larger
size (random weights; hybrid linear attention + MoE for qwen3_next).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

import mixbits
from mixbits.measure.candidates import parse_candidate, supports
from mixbits.measure.replay import Replayer
from mixbits.measure.sweep import SweepConfig, measure_site, measure_site_naive

p = argparse.ArgumentParser()
p.add_argument("--model", default="smollm2")
p.add_argument("--n-seq", type=int, default=1)
p.add_argument("--seq-len", type=int, default=256)
p.add_argument("--stock", action="store_true", help="also time the unpatched model (slow)")
args = p.parse_args()
names = ["2b_g64", "3b_g64", "4b_g64", "8b_g64"]
cands = [parse_candidate(c) for c in names]
cfg = SweepConfig(names, max_batch=8)


def setup(patch: bool):
    if args.model.startswith("tiny:"):
        import numpy as np

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import tiny_models

        arch = args.model[5:]
        big = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, head_dim=64,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                   moe_intermediate_size=256, shared_expert_intermediate_size=256,
                   linear_key_head_dim=32, linear_value_head_dim=32)
        tiny_models._BASE.update({k: v for k, v in big.items() if k in tiny_models._BASE})
        tiny_models.CONFIGS[arch].update({k: v for k, v in big.items() if k not in tiny_models._BASE})
        model, _ = tiny_models.build(arch)
        toks = np.random.default_rng(0).integers(0, 2048, (args.n_seq, args.seq_len))
    else:
        from mixbits.measure.calib import load_texts, token_sequences
        from mixbits.models import load

        model, tok, _ = load(args.model)
        toks = token_sequences(tok, load_texts(None, "auto"), args.n_seq, args.seq_len)
    if patch:
        mixbits.patch(model)
    return model, toks


def chunks(toks, chunk):
    return [mx.array(toks[i : i + chunk]) for i in range(0, len(toks), chunk)]


model, toks = setup(patch=True)
chunk = min(args.n_seq, 8)
t = time.perf_counter()
rp = Replayer(model, chunks(toks, chunk))
t_ref = time.perf_counter() - t
blocks = len(rp.adapter.blocks)
pick_blocks = sorted({round(i * (blocks - 1) / 5) for i in range(6)})
sites = []
for b in pick_blocks:  # per picked block: the value and MLP-output projections (else first and last)
    inside = [s for s in rp.adapter.sites if s.block == b and all(supports(c, s) for c in cands)]
    by_role = {rp.adapter.role(s): s for s in inside}
    sites += [by_role.get("values", inside[0]), by_role.get("down", inside[-1])]
ours = naive = naive_stock = 0.0
worst = worst_stock = 0.0
results = {}
for s in sites:
    t = time.perf_counter()
    r = measure_site(rp, s, cands, cfg)
    ours += time.perf_counter() - t
    results[s.path] = r
    for c in cands:
        t = time.perf_counter()
        k = measure_site_naive(model, toks, s, c, cfg, rp.logits, chunk)
        naive += time.perf_counter() - t
        worst = max(worst, abs(k - r.kl[c.name]) / max(k, 1e-12))
if args.stock:
    stock, _ = setup(patch=False)
    stock_ref = Replayer(stock, chunks(toks, chunk))
    for s in sites:
        for c in cands:
            t = time.perf_counter()
            ks = measure_site_naive(stock, toks, s, c, cfg, stock_ref.logits, chunk)
            naive_stock += time.perf_counter() - t
            worst_stock = max(worst_stock, abs(ks - results[s.path].kl[c.name]) / max(ks, 1e-12))
n = len(sites) * len(cands)
out = {
    "what": f"{len(sites)} tensors ({', '.join(s.path for s in sites)}) x 4 candidates "
            f"(2/3/4/8-bit g64), {args.n_seq} x {args.seq_len} tokens, {args.model}, one run",
    "model": args.model, "replayable": rp.replayable,
    "sites": len(sites), "candidate_evals": n, "tokens": int(toks.size),
    "reference_pass_s": round(t_ref, 2), "ours_s": round(ours, 2), "naive_s": round(naive, 2),
    "ours_over_naive": round(ours / naive, 3),
    "ours_candidate_tokens_per_s": round(n * toks.size / ours, 1),
    "naive_candidate_tokens_per_s": round(n * toks.size / naive, 1),
    "max_rel_kl_diff_vs_naive": worst,
}
if args.stock:
    out.update({"naive_stock_s": round(naive_stock, 2),
                "ours_over_naive_stock": round(ours / naive_stock, 4),
                "max_rel_kl_diff_vs_naive_stock": worst_stock})
print(json.dumps(out, indent=1))
