"""AWQ-style activation-aware scaling as a function-preserving transform of
the model itself, before any candidate quantizes it.

For a norm whose output feeds linears directly (q/k/v after the attention
norm, gate/up after the MLP norm), the input channels k of those linears
are scaled by s_k (searched by :func:`mixbits.quantizers.awq` on their rows
stacked, against the quantization error at ``bits``), and the norm's output
by 1/s_k -- folded into the norm's weight. In exact arithmetic the model
computes the same function; the linears' weights then spend the grid's
resolution on the channels that carry large activations, so *every*
candidate (RTN, ``+search``, ``+gptq``) quantizes them better.

Nothing here knows an architecture: the model's own forward runs with taps
on every norm-like module and every linear inside a block, and a linear
belongs to a norm's group when its input is the very array that norm
returned. Each fold is checked on the model's own output (a probe sequence):
a norm whose output also reaches something other than its linears, or whose
weight is not a plain multiplier (``1 + w`` forms are tried too), is left
alone and reported. Linears fed by something else (o_proj, down_proj) are
not scaled: folding there needs the previous linear's rows, i.e. the
model's structure.

Memory: the scaled linears become float32 ``nn.Linear`` layers (4 bytes
per weight until a candidate quantizes them) and one chunk's layer inputs
are held during capture.
"""

from __future__ import annotations

import math
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..adapter import ModelAdapter, dense_weight
from ..layout import DEFAULT_GROUP_SIZE
from .replay import token_chunks
from .sweep import kl_per_token
from .taps import Taps, split_key

PROBE_KL = 1e-4  # mean KL (nats/token) a fold may move the probe's logits


def is_norm(m) -> bool:
    """A norm-like module with a 1-D weight: what a fold can rescale."""
    w = m.get("weight") if isinstance(m, nn.Module) else None
    return isinstance(w, mx.array) and w.ndim == 1 and "norm" in type(m).__name__.lower()


def _new_weights(w0: mx.array, inv: mx.array):
    """Candidate weights for a norm whose output is to be multiplied by inv:
    y = w * n(x) and y = (1 + w) * n(x)."""
    w = w0.astype(mx.float32)
    return [("weight", (w * inv).astype(w0.dtype)), ("offset", ((1 + w) * inv - 1).astype(w0.dtype))]


def _groups(t: Taps, norms: dict, linears: set) -> dict[str, list[str]]:
    """norm path -> linear paths whose every call reads that norm's output."""
    src_of: dict[str, set] = {}
    for key, src in t.sources.items():
        path, _ = split_key(key)
        if path in linears:
            src_of.setdefault(path, set()).add(split_key(src)[0] if src else None)
    out: dict[str, list[str]] = {}
    for path, srcs in src_of.items():
        if len(srcs) == 1 and (norm := next(iter(srcs))) in norms:
            out.setdefault(norm, []).append(path)
    return out


def scale_model(model, tokens, bits: int, group_size: int = DEFAULT_GROUP_SIZE, *, grid: int = 20,
                sample_rows: int = 512, chunk: int = 4, scale_dtype=mx.float16,
                progress: bool = True) -> list[dict]:
    """Apply AWQ scales in place; returns one record per norm-fed group:
    ``{"norm", "linears", "scaled", "form", "probe_kl", "reason",
    "inv_scales"}`` (inv_scales: numpy (K,), what the group's inputs are
    now multiplied by, so a caller can carry X^T X over: D H D)."""
    from .. import quantizers

    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.size == 0:
        raise ValueError(f"tokens must be a non-empty [n_seq, seq_len] array, got shape {tokens.shape}")
    adapter = ModelAdapter(model)
    lin = {s.path: s for s in adapter.sites if s.form == "linear" and s.block is not None}
    norms = {p: m for p, m in model.named_modules() if is_norm(m)}
    chunks = token_chunks(tokens, chunk)
    stride = max(1, math.ceil(tokens.size / sample_rows))

    absum, rows, norm_in, groups = {}, {}, {}, None
    with Taps({**{p: adapter.get(p) for p in lin}, **norms}) as t:
        for c in chunks:
            t.capture()
            mx.eval(model(c))
            if groups is None:
                groups = _groups(t, norms, set(lin))
            for norm, paths in groups.items():
                x = t.inputs[f"{paths[0]}|call|0"].astype(mx.float32)
                x = np.array(x.reshape(-1, x.shape[-1]))
                absum[norm] = absum.get(norm, 0) + np.abs(x).sum(0, dtype=np.float64)
                rows.setdefault(norm, []).append(x[::stride])
                if norm not in norm_in:
                    xi = t.inputs[f"{norm}|call|0"]
                    norm_in[norm] = xi.reshape(-1, xi.shape[-1])[:64]
    probe = mx.array(tokens[:1, : min(tokens.shape[1], 64)])
    ref = model(probe).astype(mx.float32)
    mx.eval(ref)

    report = []
    items = sorted(groups.items())
    if progress:
        from tqdm import tqdm
        items = tqdm(items, desc="awq scales", unit="group")
    for norm, paths in items:
        rec = {"norm": norm, "linears": paths, "scaled": False, "form": None, "probe_kl": None,
               "reason": None, "inv_scales": None}
        report.append(rec)
        k = lin[paths[0]].k
        if k % group_size:
            rec["reason"] = f"K={k} is not a multiple of group size {group_size}"
            continue
        olds = {p: adapter.get(p) for p in paths}
        w = np.concatenate([np.array(dense_weight(m).astype(mx.float32)) for m in olds.values()])
        n_tok = tokens.size
        _, inv = quantizers.awq(w, [(bits, group_size, k)], absum[norm] / n_tok,
                                X_sample=np.concatenate(rows[norm]), grid=grid, dtype=scale_dtype)
        if bool(mx.all(inv == 1).item()):
            rec["reason"] = "the search kept s = 1 (no scaling beats round-to-nearest)"
            continue
        m = norms[norm]
        w0, b0 = m.weight, m.get("bias")
        want = (m(norm_in[norm]).astype(mx.float32) * inv)
        for form, wn in _new_weights(w0, inv):
            m.weight = wn
            if b0 is not None:
                m.bias = (b0.astype(mx.float32) * inv).astype(b0.dtype)
            got = m(norm_in[norm]).astype(mx.float32)
            if float(mx.linalg.norm(got - want) / (mx.linalg.norm(want) + 1e-30)) < 1e-2:
                rec["form"] = form
                break
        if rec["form"] is None:
            m.weight = w0
            if b0 is not None:
                m.bias = b0
            rec["reason"] = "the norm's weight is neither y = w*n(x) nor y = (1+w)*n(x)"
            continue
        for p, old in olds.items():
            layer = nn.Linear(k, lin[p].shape[0], bias=old.get("bias") is not None)
            layer.weight = dense_weight(old).astype(mx.float32) / inv
            if old.get("bias") is not None:
                layer.bias = old["bias"]
            adapter.set(p, layer)
        kl = float(kl_per_token(ref, model(probe)).mean())
        rec["probe_kl"] = kl
        if not kl <= PROBE_KL:  # the norm's output reaches more than these linears
            m.weight = w0
            if b0 is not None:
                m.bias = b0
            for p, old in olds.items():
                adapter.set(p, old)
            rec["reason"] = f"folding moved the model's output (probe KL {kl:.3g} > {PROBE_KL})"
            continue
        rec["scaled"], rec["inv_scales"] = True, np.array(inv)
    if not any(r["scaled"] for r in report):
        warnings.warn("AWQ scaling changed nothing: no norm-fed linear group was scaled", RuntimeWarning,
                      stacklevel=2)
    return report


def apply_awq(model, tokens, name: str, progress: bool = True) -> list[dict]:
    """``--awq``: scale ``model`` in place and print what was scaled."""
    from .candidates import awq_kind

    cand = awq_kind(name)
    report = scale_model(model, tokens, cand.bits, cand.group_size, progress=progress)
    n = sum(r["scaled"] for r in report)
    print(f"awq {name}: scaled {n} of {len(report)} norm-fed linear groups "
          f"({sum(len(r['linears']) for r in report if r['scaled'])} linears)")
    return report
