"""A gradient proxy for the sweep: every tensor x candidate's KL estimated
from a few backward passes, no forward per candidate.

At the reference weights the KL of the final logits is at its minimum
(zero), so its gradient vanishes and the first change is second order:

    KL(P || Q_{W+dW}) ~= 1/2 dW^T F dW,

with F the Fisher information of the model's output distribution. We keep
F's diagonal, estimated without bias from one backward pass per sequence:
sample y_t ~ P(.|x_<t) at every position from the reference logits, take
the gradient g of sum_t -log q(y_t) w.r.t. every tensor, and accumulate g^2
(the cross terms g_t g_s, t != s, have zero mean because each y_t is drawn
independently, so E[(sum_t g_t)^2] = sum_t E[g_t^2]). The estimate of a
candidate is 1/2 sum F (W_c - W)^2 / tokens, mean KL per token as the exact
sweep reports it.

Cost: ``samples`` backward passes (about three forwards each) per sequence
for all tensors together, plus one quantization per tensor x candidate;
the exact sweep runs about half a model forward per tensor x candidate.
The estimate ignores off-diagonal curvature (interactions inside a tensor
and between layers), so it ranks better than it predicts: ``two-stage``
(mixbits.measure.two_stage) measures exactly where that matters.
"""

from __future__ import annotations

import math
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def _float_stack(m, w):
    """A float twin of an expert stack (mlx-lm's SwitchLinear), or None."""
    try:
        from mlx_lm.models.switch_layers import SwitchLinear
    except ImportError:  # pragma: no cover - mlx-lm is a test dependency
        return None
    if type(m).__name__ not in ("SwitchLinear", "QuantizedSwitchLinear"):
        return None
    e, n, k = w.shape
    twin = SwitchLinear(k, n, e, bias="bias" in m)
    twin.weight = w
    if "bias" in m:
        twin.bias = m["bias"]
    return twin


def fisher_diagonal(model, tokens, sites, *, samples: int = 1, seed: int = 0, progress: bool = True):
    """{path: diag Fisher summed over tokens (float32, weight shape)} and
    the token count. ``sites``: adapter Sites of ``model``."""
    from tqdm import tqdm

    from ..adapter import ModelAdapter, dense_weight
    from .dynamic_quant import float_copy

    twin = float_copy(model)
    ad = ModelAdapter(twin)
    paths = [s.path for s in sites]
    for s in sites:
        m = ad.get(s.path)
        if s.form == "stack" and "scales" in m:
            f = _float_stack(m, dense_weight(m))
            if f is None:
                raise ValueError(f"{s.path}: no float twin for {type(m).__name__}; "
                                 "the gradient proxy cannot differentiate it")
            ad.set(s.path, f)
    twin.freeze()
    for p in paths:
        ad.get(p).unfreeze(keys=["weight"], recurse=False)

    def loss(batch, targets):
        logits = twin(batch).astype(mx.float32)
        lse = mx.logsumexp(logits, axis=-1)
        picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return (lse - picked).sum()

    grad_fn = nn.value_and_grad(twin, loss)
    key = mx.random.key(seed)
    fisher = {p: mx.zeros(ad.get(p)["weight"].shape, dtype=mx.float32) for p in paths}
    toks = np.asarray(tokens)
    bar = tqdm(total=len(toks) * samples, desc="fisher", unit="seq", disable=not progress)
    for i in range(len(toks)):
        batch = mx.array(toks[i : i + 1])
        ref = model(batch).astype(mx.float32)
        for _ in range(samples):
            key, sub = mx.random.split(key)
            y = mx.random.categorical(ref, key=sub)  # y_t ~ P(.|x_<t)
            _, grads = grad_fn(batch, y)
            flat = dict(_flatten(grads))
            for p in paths:
                g = flat[p + ".weight"].astype(mx.float32)
                fisher[p] = fisher[p] + g * g
            mx.eval(list(fisher.values()))
            bar.update(1)
    bar.close()
    n_tok = toks.size * samples
    return fisher, n_tok


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def estimate(fisher: mx.array, n_tokens: int, original, layer) -> float:
    """1/2 sum F (W_c - W)^2 per token for one tensor and candidate layer."""
    from ..adapter import dense_weight

    d = dense_weight(layer) - dense_weight(original)
    return float(0.5 * (fisher * d * d).sum().item() / n_tokens)


def grad_entries(model, tokens, sites, site_cands, *, scale_dtype=None, samples: int = 1,
                 seed: int = 0, progress: bool = True) -> list[dict]:
    """Table entries (the sweep's layout) with proxy KLs for ``sites``."""
    from ..adapter import ModelAdapter
    from .candidates import build_layer
    from .sweep import storage_bits

    t0 = time.perf_counter()
    fisher, n_tok = fisher_diagonal(model, tokens, sites, samples=samples, seed=seed,
                                    progress=progress)
    per_site = (time.perf_counter() - t0) / max(1, len(sites))
    ad = ModelAdapter(model)
    out = []
    for s in sites:
        t1 = time.perf_counter()
        original = ad.get(s.path)
        cands = []
        for c in site_cands[s.path]:
            layer = build_layer(original, c, scale_dtype)
            sb = storage_bits(layer, s)
            cands.append({"kind": c.name, "bits": c.nominal_bits,
                          "kl": estimate(fisher[s.path], n_tok, original, layer),
                          "storage_bits": sb, "bpw": sb / s.nparams, "group_size": c.group_size,
                          "source": "grad"})
        entry = {"path": s.path}
        if s.block is not None:
            entry["layer"] = s.block
        out.append({**entry, "nparams": s.nparams, "shape": list(s.shape), "candidates": cands,
                    "seconds": round(per_site + time.perf_counter() - t1, 3)})
    return out
