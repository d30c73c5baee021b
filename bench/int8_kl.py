"""End-to-end cost of activations="int8" and "int16" on SmolLM2-135M: mean
KL of the next-token distribution, integer path vs the float path, on the
calibration tokens, all on the same patched model.

The int8 contract runs only for calls of at most 16 rows, so the tokens go
through the model in chunks of 16 with a KV cache (exactly decode's
numerics: every activation row is quantized on its own, so a row's result
does not depend on the chunk it came in). The float run uses the same
chunks. Writes bench/results/int8_kl.json.

    python bench/int8_kl.py [--n-seq 8] [--seq-len 256] [--contracts int8,int16]

Prefill with activations="int8-all" (the int8 contract at every M): each
sequence in one call of --chunk rows, float run likewise:

    python bench/int8_kl.py --contracts int8-all --chunk 256 --by-kind 0 \
        --out bench/results/int8_all_prefill_kl.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mixbits
from mixbits.measure import calib

CHUNK = 16


def logits_chunked(model, ids, chunk=CHUNK):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = []
    for i in range(0, ids.shape[1], chunk):
        y = model(ids[:, i:i + chunk], cache=cache).astype(mx.float32)
        mx.eval(y)
        out.append(y)
    return mx.concatenate(out, axis=1)


def mixbits_layers(model):
    kinds = (mixbits.nn.MixedQuantizedLinear, mixbits.nn.MixedQuantizedEmbedding)
    return {p: m for p, m in model.named_modules() if isinstance(m, kinds)}


def set_activations(model, act, select=lambda path: True):
    for p, m in mixbits_layers(model).items():
        m.activations = act if select(p) else "float"


# Which layers the int8 error comes from: int8 on one kind of layer only.
KINDS = {
    "tied head (embed_tokens.as_linear)": lambda p: "embed" in p or "lm_head" in p,
    "q/k/v/o_proj": lambda p: "self_attn" in p,
    "o_proj": lambda p: "o_proj" in p,
    "gate/up_proj": lambda p: "gate_proj" in p or "up_proj" in p,
    "down_proj": lambda p: "down_proj" in p,
}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-seq", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--contracts", default="int8,int16", help="integer contracts to compare with float")
    ap.add_argument("--by-kind", type=int, default=2, metavar="N",
                    help="also the mean KL with int8 on one kind of layer only, over the first N sequences")
    ap.add_argument("--chunk", type=int, default=CHUNK,
                    help="rows per model call (16: decode's numerics; the sequence length: one "
                         "prefill call, which only int8-all runs on the integer kernels)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "int8_kl.json"))
    a = ap.parse_args(argv)
    mx.set_default_device(mx.cpu)
    model, tok, config = mixbits.load("smollm2")
    replaced = mixbits.patch(model, activations="float")
    toks = calib.token_sequences(tok, calib.load_texts(None, "auto"), a.n_seq, a.seq_len)
    contracts = a.contracts.split(",")
    kls = {c: [] for c in contracts}
    agree = {c: [] for c in contracts}
    t = {c: 0.0 for c in ["float", *contracts]}
    for s in range(a.n_seq):
        ids = mx.array(toks[s:s + 1])
        res = {}
        for act in ("float", *contracts):
            set_activations(model, act)
            t0 = time.perf_counter()
            res[act] = logits_chunked(model, ids, a.chunk)[0]
            t[act] += time.perf_counter() - t0
        for c in contracts:
            kl = np.array(mixbits.kl_divergence(res["float"], res[c]), np.float64)
            kls[c].append(kl)
            agree[c].append(np.array(mx.argmax(res["float"], -1) == mx.argmax(res[c], -1)))
            print(f"seq {s} {c}: mean KL {kl.mean():.3e}, max {kl.max():.3e}")
    by_kind = {}
    if a.by_kind and "int8" in contracts:
        set_activations(model, "float")
        base = [logits_chunked(model, mx.array(toks[s:s + 1]))[0] for s in range(a.by_kind)]
        for name, sel in KINDS.items():
            set_activations(model, "int8", sel)
            k = [np.array(mixbits.kl_divergence(b, logits_chunked(model, mx.array(toks[s:s + 1]))[0]))
                 for s, b in enumerate(base)]
            by_kind[name] = float(np.concatenate(k).mean())
            print(f"int8 on {name} only: mean KL {by_kind[name]:.3e}")

    def summary(c):
        kl = np.concatenate(kls[c])
        n = kl.size
        return {
            "mean": float(kl.mean()), "stderr": float(kl.std(ddof=1) / np.sqrt(n)),
            "median": float(np.median(kl)), "p99": float(np.quantile(kl, 0.99)),
            "p99.9": float(np.quantile(kl, 0.999)), "max": float(kl.max()), "n_tokens": int(n),
            "same_top1": float(np.concatenate(agree[c]).mean()),
        }

    out = {
        "model": "smollm2 (mixbits.load, patched: {} layers)".format(len(replaced)),
        "tokens": {"n_seq": a.n_seq, "seq_len": a.seq_len, "source": "calib.load_texts(None, 'auto')"},
        "chunk_rows": a.chunk,
        "kl_vs_float": {c: summary(c) for c in contracts},
        "mean_kl_int8_on_one_kind_only": {"n_seq": a.by_kind, **by_kind},
        "goal_mean_kl": 1e-3,
        "wall_s": t,
        "host": platform.machine(),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["kl_vs_float"], indent=1))


if __name__ == "__main__":
    main()
