"""An ExLlamaV2-style ``measurement.json`` from a model, for that tool's
users: per module (``model.layers.N.self_attn`` and ``.mlp``) and per
option, ``accuracy = 1 - mean over calibration tokens of |y_q - y| / |y|``
where y is the module's output -- the residual stream after the module,
as ExLlamaV2's attention and MLP modules include the input norm and the
residual add -- with every projection of the module quantized at the
option and the reference hidden state as input. ``total_bits`` follows
ExLlamaV2's storage formula (mixbits.formats.exl2), so its optimizer and
``mixbits allocate`` read the file unchanged.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..formats.exl2 import Measurement, Option, ProjectionQuant
from .candidates import Candidate, parse_candidate
from .checkpoint import read_json
from .model import LayeredModel, Site
from .sweep import Reference, _bias_of, candidate_layer, dense_weight

MODULES = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def _attn_half(layer, h):
    mask = "causal" if h.shape[1] > 1 else None
    return h + layer.self_attn(layer.input_layernorm(h), mask, cache=None)


def _mlp_half(layer, h):
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _projection_quant(c: Candidate) -> ProjectionQuant:
    if c.kind == "uniform":
        return ProjectionQuant((c.bits,), (1.0,), {c.bits: c.group_size}, 4)
    if c.kind == "mixed":
        p = c.hi_percent / 100
        return ProjectionQuant((c.hi_bits, c.lo_bits), (p, 1 - p),
                               {c.hi_bits: c.group_size, c.lo_bits: c.group_size}, 4)
    raise ValueError(f"candidate {c.name!r}: ExLlamaV2 has no ternary option")


def measure_modules(model, tokens, candidates, out, *, chunk: int = 4, resume: bool = False,
                    progress: bool = True) -> dict:
    """Write (and return) measurement.json for ``model`` on ``tokens``;
    checkpointed atomically after every module, resumable."""
    from tqdm import tqdm

    cands = [parse_candidate(c) for c in candidates]
    pquant = {c.name: _projection_quant(c) for c in cands}
    lm = LayeredModel(model)
    sites = {s.path: s for s in lm.sites()}
    done = {}
    if resume:
        try:
            done = {k: v for k, v in read_json(out, "measurement")["measurement"].items() if v}
        except FileNotFoundError:
            pass
    keys = [f"model.layers.{i}.{m}" for i in range(len(lm.layers)) for m in MODULES]
    todo = [k for k in keys if k not in done]
    ref = Reference(lm, np.asarray(tokens), chunk) if todo else None
    bar = tqdm(total=len(keys) * len(cands), initial=(len(keys) - len(todo)) * len(cands),
               unit="opt", desc="exl2 measure", disable=not progress)
    for key in todo:
        i, mod = int(key.split(".")[2]), key.split(".")[3]
        layer = lm.layers[i]
        half = _attn_half if mod == "self_attn" else _mlp_half
        paths = [f"model.layers.{i}.{mod}.{p}" for p in MODULES[mod]]
        missing = [p for p in paths if p not in sites]
        if missing:
            raise ValueError(f"{key}: the model has no {missing}; only llama-style blocks are supported")
        proj_sites: list[Site] = [sites[p] for p in paths]
        originals = [lm.get(s) for s in proj_sites]
        inputs, refs = [], []
        for ci in range(len(ref.chunks)):
            h = ref.hidden[ci][i]
            if mod == "mlp":
                h = _attn_half(layer, h)
            y = half(layer, h)
            mx.eval(h, y)
            inputs.append(h)
            refs.append(y)
        shapes = {s.name.rsplit(".", 1)[-1]: (s.shape[1], s.shape[0]) for s in proj_sites}
        opts = []
        for c in cands:
            try:
                for s, o in zip(proj_sites, originals):
                    lm.set(s, candidate_layer(dense_weight(o), _bias_of(o), c, mx.float16)[0])
                rel = []
                for h, y in zip(inputs, refs):
                    yq = half(layer, h).astype(mx.float32)
                    y32 = y.astype(mx.float32)
                    r = mx.linalg.norm(yq - y32, axis=-1) / mx.linalg.norm(y32, axis=-1)
                    rel.append(np.array(r, dtype=np.float64).ravel())
            finally:
                for s, o in zip(proj_sites, originals):
                    lm.set(s, o)
            projs = {p: pquant[c.name] for p in MODULES[mod]}
            opt = Option(float(1.0 - np.concatenate(rel).mean()), 0, projs)
            opt.total_bits = opt.recompute_total_bits(shapes)
            opts.append(opt.to_dict())
            bar.update(1)
        done[key] = opts
        _write(out, keys, done)
    bar.close()
    return _write(out, keys, done)


def _write(out, keys, done) -> dict:
    modules = {k: done.get(k) for k in keys}
    modules["model.norm.norm"] = None
    modules["lm_head.linear"] = None
    # ExLlamaV2 numbers modules embedding (0), attn/mlp per layer, norm, head.
    m = Measurement.from_dict({"measurement": modules, "last_module_idx": len(keys) + 2})
    m.save(out)
    return m.to_dict()
