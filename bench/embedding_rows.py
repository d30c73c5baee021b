"""Where an embedding's quantization error goes, and what row bands buy.

The embedding alone is quantized (every other tensor float), at a kind and
at the same kind with its first R rows at 8 bits (``8b@R_<kind>``, built by
mixbits' own candidate constructor), and the model's KL against itself is
split by role on held-out text: lookups only (the quantized table looked
up, the float table as head), head only (the float table looked up, the
quantized one as head), both. Also: the share of held-out and calibration
tokens whose ids are below R (byte-pair / SentencePiece vocabularies number
frequent pieces first). ``+search`` here is unweighted (no head input
recorded): the protocol's figures (bench/quality_protocol.py) are the ones
a claim rests on; this shows the mechanism.

Run:  python bench/embedding_rows.py --model gemma3 --out bench/results/embedding_rows_gemma3.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from quality_protocol import host, token_sets  # noqa: E402


class _Rows(nn.Module):
    """A table looked up by the model (its head left to the caller)."""

    def __init__(self, table):
        super().__init__()
        object.__setattr__(self, "table", table)

    def __call__(self, ids):
        return self.table(ids)

    def as_linear(self, x):  # the head input itself: logits are formed outside
        return x


def _head_inputs(model, table, windows) -> np.ndarray:
    """The final norm's output [tokens, dims] with ``table`` looked up."""
    inner = model.model.embed_tokens
    model.model.embed_tokens = _Rows(table)
    try:
        out = []
        for i in range(0, len(windows), 2):
            h = model(mx.array(windows[i:i + 2]))
            mx.eval(h)
            out.append(np.array(h.astype(mx.float32)).reshape(-1, h.shape[-1]))
    finally:
        model.model.embed_tokens = inner
    return np.concatenate(out)


def _log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _kl(h_ref, w_ref, h, w) -> float:
    tot = []
    for i in range(0, len(h_ref), 256):
        p, q = _log_softmax(h_ref[i:i + 256] @ w_ref.T), _log_softmax(h[i:i + 256] @ w.T)
        tot.append((np.exp(p) * (p - q)).sum(-1))
    return float(np.concatenate(tot).mean())


def main() -> int:
    import mixbits
    from mixbits.adapter import ModelAdapter, dense_weight
    from mixbits.measure.calib import cast_model
    from mixbits.measure.candidates import build_layer, parse_candidate
    from mixbits.measure.sweep import storage_bits
    from mixbits.nn import patch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--kinds", nargs="+", default=["4b_g64+search", "8b@4096_4b_g64+search",
                                                   "8b@8192_4b_g64+search"])
    ap.add_argument("--windows", type=int, default=8, help="held-out license windows of 256 tokens")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    t0 = time.perf_counter()
    model, tok, _ = mixbits.load(args.model)
    cast_model(model, "float32")
    patch(model)
    calib, held = token_sets(tok, [0])
    windows = held["licenses"][:args.windows]
    emb = model.model.embed_tokens
    site = next(s for s in ModelAdapter(model).sites if s.form == "embedding")
    w = np.array(dense_weight(emb))
    ids_h, ids_c = np.array(windows).ravel(), np.array(calib[0]).ravel()
    coverage = {str(r): {"held_out": float((ids_h < r).mean()), "calibration": float((ids_c < r).mean())}
                for r in (1024, 4096, 8192, 16384)}
    h_ref = _head_inputs(model, emb, windows)
    rows = []
    for kind in args.kinds:
        t = time.perf_counter()
        layer = build_layer(emb, parse_candidate(kind))
        q = np.array(dense_weight(layer))
        h_q = _head_inputs(model, layer, windows)
        rows.append({"kind": kind, "storage_bpw": storage_bits(layer, site) / site.nparams,
            "kl_lookups": _kl(h_ref, w, h_q, w), "kl_head": _kl(h_ref, w, h_ref, q),
            "kl_both": _kl(h_ref, w, h_q, q), "seconds": round(time.perf_counter() - t, 1)})
        print(json.dumps(rows[-1]), flush=True)
    out = {"model": args.model, "host": host(), "vocab": int(w.shape[0]), "dims": int(w.shape[1]),
           "held_out": f"licenses, {args.windows} x 256", "reference": "the model as loaded, float32",
           "search": "unweighted (+search without the head input)", "first_ids_share": coverage,
           "rows": rows, "wall_s": round(time.perf_counter() - t0, 1)}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
