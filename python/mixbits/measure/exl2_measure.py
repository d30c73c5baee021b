"""An ExLlamaV2-style ``measurement.json`` from a model, for that tool's
users: per module and per option, ``accuracy = 1 - mean over calibration
tokens of |y_q - y| / |y|``, with every projection of the module quantized
at the option.

Modules are the direct children of each decoder block that hold
quantizable tensors, as the model adapter groups them
(``model.layers.N.self_attn``, ``.mlp``, ``.linear_attn`` ...). y is the
output of the model's own block (the residual stream after it) run on the
recorded reference input with the recorded arguments; so for the
block's last module (the MLP) this is exactly ExLlamaV2's module output,
and for earlier ones it includes the rest of the block at full precision.
``total_bits`` follows ExLlamaV2's storage formula (mixbits.formats.exl2),
so its optimizer and ``mixbits allocate`` read the file unchanged.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..adapter import ModelAdapter, get_module, set_module
from ..lock import locks_output
from ..formats.exl2 import Measurement, Option, ProjectionQuant
from .candidates import Candidate, build_layer, parse_candidate, supports
from ..formats.errors import load_json
from .replay import Replayer, token_chunks


def _projection_quant(c: Candidate) -> ProjectionQuant:
    if c.kind == "uniform":
        return ProjectionQuant((c.bits,), (1.0,), {c.bits: c.group_size}, 4)
    if c.kind == "mixed":
        p = c.hi_percent / 100
        return ProjectionQuant((c.hi_bits, c.lo_bits), (p, 1 - p),
                               {c.hi_bits: c.group_size, c.lo_bits: c.group_size}, 4)
    if c.kind == "fp":
        raise ValueError(f"candidate {c.name!r}: ExLlamaV2 has no {c.mode} option (an MLX mode)")
    raise ValueError(f"candidate {c.name!r}: ExLlamaV2 has no ternary option")


@locks_output
def measure_modules(model, tokens, candidates, out, *, chunk: int = 4, resume: bool = False,
                    progress: bool = True) -> dict:
    """Write (and return) measurement.json for ``model`` on ``tokens``;
    checkpointed atomically after every module, resumable, under ``out``'s
    lock (one writer)."""
    from tqdm import tqdm

    cands = [parse_candidate(c) for c in candidates]
    pquant = {c.name: _projection_quant(c) for c in cands}
    adapter = ModelAdapter(model)
    groups = adapter.groups()
    if not groups:
        raise ValueError("the model has no decoder blocks (model.layers) to group into modules")
    from .sweep import model_fingerprint, settings_mismatch, token_settings

    tokens = np.asarray(tokens)
    # Recorded beside ExLlamaV2's keys (its readers keep unknown ones): a
    # resume continues only a measurement of this model, tokens and options.
    meta = {"method": "exl2-module", "model_fingerprint": model_fingerprint(model),
            **token_settings(tokens), "candidates": [c.name for c in cands]}
    done = {}
    if Path(out).exists():
        if not resume:
            raise FileExistsError(f"{out} exists; pass resume=True (--resume) to continue it")
        prev = load_json(out, "measurement")
        settings_mismatch(out, prev.get("mixbits_meta") if isinstance(prev, dict) else None, meta)
        done = {k: v for k, v in prev["measurement"].items() if v}
    keys = list(groups)
    todo = [k for k in keys if k not in done]
    rp = Replayer(model, token_chunks(tokens, chunk), adapter) if todo else None
    if rp is not None and not rp.replayable:
        raise ValueError(f"cannot write an ExLlamaV2 measurement: {rp.reason}")
    bar = tqdm(total=len(keys) * len(cands), initial=(len(keys) - len(todo)) * len(cands),
               unit="opt", desc="exl2 measure", disable=not progress)
    for key in todo:
        sites = groups[key]
        i = sites[0].block
        block = adapter.blocks[i]
        local = [adapter.local_path(s) for s in sites]
        names = [s.path[len(key) + 1 :] for s in sites]
        originals = [get_module(block, p) for p in local]
        shapes = {n: (s.shape[-1], s.nparams // s.shape[-1]) for n, s in zip(names, sites)}
        opts = []
        for c in cands:
            if not all(supports(c, s) for s in sites):
                bar.update(1)
                continue
            try:
                for p, o in zip(local, originals):
                    set_module(block, p, build_layer(o, c, mx.float16))
                rel = []
                for recs in rp.records:
                    args, kwargs, y = recs[i]
                    yq = block(*args, **kwargs)
                    yq = (yq[0] if isinstance(yq, tuple) else yq).astype(mx.float32)
                    y32 = (y[0] if isinstance(y, tuple) else y).astype(mx.float32)
                    r = mx.linalg.norm(yq - y32, axis=-1) / mx.linalg.norm(y32, axis=-1)
                    rel.append(np.array(r, dtype=np.float64).ravel())
            finally:
                for p, o in zip(local, originals):
                    set_module(block, p, o)
            projs = {n: pquant[c.name] for n in names}
            opt = Option(float(1.0 - np.concatenate(rel).mean()), 0, projs)
            opt.total_bits = opt.recompute_total_bits(shapes)
            opts.append(opt.to_dict())
            bar.update(1)
        done[key] = opts
        _write(out, keys, done, meta)
    bar.close()
    return _write(out, keys, done, meta)


def _write(out, keys, done, meta) -> dict:
    modules = {k: done.get(k) for k in keys}
    modules["model.norm.norm"] = None
    modules["lm_head.linear"] = None
    # ExLlamaV2 numbers modules embedding (0), attn/mlp per layer, norm, head.
    m = Measurement.from_dict({"measurement": modules, "last_module_idx": len(keys) + 2,
                               "mixbits_meta": meta})
    m.save(out)
    return m.to_dict()
