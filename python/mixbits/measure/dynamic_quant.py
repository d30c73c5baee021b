"""mlx-lm's ``dynamic_quant`` recipe as a baseline, on our calibration
tokens and our sensitivity table's tensors.

mlx-lm estimates each tensor's sensitivity from one backward pass per
batch (the KL gradient at the low-bit weights, dotted with the low-to-high
quantization step) and gives the high width to every tensor above a
threshold chosen for the target bits per weight. We call its own
``estimate_sensitivities`` (it cannot download its dataset here, so it gets
our tokens) on a float copy of the model, then pick the threshold against
the table's storage bits so the baseline is compared at equal storage bpw.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn


def float_copy(model):
    """A copy of ``model`` whose quantizable tensors are plain float
    Linear/Embedding layers (dense weights), with no mixbits routing, so
    MLX can differentiate it as mlx-lm expects."""
    from ..adapter import ModelAdapter, dense_weight
    from ..routing import unpatch_functions

    twin = copy.deepcopy(model)
    unpatch_functions(twin)
    ad = ModelAdapter(twin)
    for s in ad.sites:
        m = ad.get(s.path)
        if s.form == "stack" or isinstance(m, (nn.Linear, nn.Embedding)):
            continue
        w = dense_weight(m)
        if s.form == "embedding":
            new = nn.Embedding(*w.shape)
        else:
            new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            if "bias" in m:
                new.bias = m["bias"]
        new.weight = w
        ad.set(s.path, new)
    twin.eval()
    return twin


def sensitivities(model, tokens, low=(4, 64), high=(5, 64), batch_size: int = 4) -> dict[str, float]:
    """mlx-lm's per-tensor sensitivity (module path -> score)."""
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities

    twin = float_copy(model)
    data = mx.array(tokens)
    sens = estimate_sensitivities(twin, data, low[0], low[1], high[0], high[1], batch_size=batch_size)
    return dict(sens)


def assignment(table: dict, sens: dict[str, float], target_bpw: float, low: str, high: str) -> dict[str, str]:
    """Every tensor at ``low``; the most sensitive ones at ``high`` while
    the table's storage bpw stays <= ``target_bpw`` (mlx-lm's threshold,
    found by sorting rather than bisection: the same set)."""
    entries = table["entries"]
    total = sum(e["nparams"] for e in entries)

    def bits(e, name):
        for c in e["candidates"]:
            if c["kind"] == name:
                return c["storage_bits"]
        raise ValueError(f"{e['path']}: candidate {name!r} was not measured; dynamic_quant needs it")

    out = {e["path"]: low for e in entries}
    used = sum(bits(e, low) for e in entries)
    if used > target_bpw * total:
        raise ValueError(f"target {target_bpw} bpw is below uniform {low} ({used / total:.3f} bpw)")
    ranked = sorted((e for e in entries if e["path"] in sens), key=lambda e: -sens[e["path"]])
    for e in ranked:
        step = bits(e, high) - bits(e, low)
        if used + step > target_bpw * total:
            break  # a threshold: everything above it is high, nothing below
        out[e["path"]] = high
        used += step
    return out
