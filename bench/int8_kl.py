"""End-to-end cost of activations="int8" on SmolLM2-135M: mean KL of the
next-token distribution, int8 path vs the float path, on the calibration
tokens, both on the same patched model.

The int8 contract runs only for calls of at most 16 rows, so the tokens go
through the model in chunks of 16 with a KV cache (exactly decode's
numerics: every activation row is quantized on its own, so a row's result
does not depend on the chunk it came in). The float run uses the same
chunks. Writes bench/results/int8_kl.json.

    python bench/int8_kl.py [--n-seq 8] [--seq-len 256]
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


def logits_chunked(model, ids):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = []
    for i in range(0, ids.shape[1], CHUNK):
        y = model(ids[:, i:i + CHUNK], cache=cache).astype(mx.float32)
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
    ap.add_argument("--by-kind", type=int, default=2, metavar="N",
                    help="also the mean KL with int8 on one kind of layer only, over the first N sequences")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "int8_kl.json"))
    a = ap.parse_args(argv)
    mx.set_default_device(mx.cpu)
    model, tok, config = mixbits.load("smollm2")
    replaced = mixbits.patch(model, activations="float")
    toks = calib.token_sequences(tok, calib.load_texts(None, "auto"), a.n_seq, a.seq_len)
    kls, agree, t = [], [], {"float": 0.0, "int8": 0.0}
    for s in range(a.n_seq):
        ids = mx.array(toks[s:s + 1])
        res = {}
        for act in ("float", "int8"):
            set_activations(model, act)
            t0 = time.perf_counter()
            res[act] = logits_chunked(model, ids)[0]
            t[act] += time.perf_counter() - t0
        kl = np.array(mixbits.kl_divergence(res["float"], res["int8"]), np.float64)
        kls.append(kl)
        agree.append(np.array(mx.argmax(res["float"], -1) == mx.argmax(res["int8"], -1)))
        print(f"seq {s}: mean KL {kl.mean():.3e}, max {kl.max():.3e}")
    by_kind = {}
    if a.by_kind:
        set_activations(model, "float")
        base = [logits_chunked(model, mx.array(toks[s:s + 1]))[0] for s in range(a.by_kind)]
        for name, sel in KINDS.items():
            set_activations(model, "int8", sel)
            k = [np.array(mixbits.kl_divergence(b, logits_chunked(model, mx.array(toks[s:s + 1]))[0]))
                 for s, b in enumerate(base)]
            by_kind[name] = float(np.concatenate(k).mean())
            print(f"int8 on {name} only: mean KL {by_kind[name]:.3e}")
    kl = np.concatenate(kls)
    same = np.concatenate(agree)
    n = kl.size
    out = {
        "model": "smollm2 (mixbits.load, patched: {} layers)".format(len(replaced)),
        "tokens": {"n_seq": a.n_seq, "seq_len": a.seq_len, "source": "calib.load_texts(None, 'auto')"},
        "chunk_rows": CHUNK,
        "kl_int8_vs_float": {
            "mean": float(kl.mean()), "stderr": float(kl.std(ddof=1) / np.sqrt(n)),
            "median": float(np.median(kl)), "p99": float(np.quantile(kl, 0.99)),
            "p99.9": float(np.quantile(kl, 0.999)), "max": float(kl.max()), "n_tokens": int(n),
        },
        "same_top1": float(same.mean()),
        "mean_kl_int8_on_one_kind_only": {"n_seq": a.by_kind, **by_kind},
        "goal_mean_kl": 1e-3,
        "wall_s": t,
        "host": platform.machine(),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["kl_int8_vs_float"], indent=1), "same top-1:", out["same_top1"])


if __name__ == "__main__":
    main()
