"""Per-tensor sensitivity sweep: quantize one tensor at one candidate, run
the model on calibration tokens, KL of the final logits vs the reference.

Speed comes from three things:
- the reference hidden state at the input of every layer is computed once,
  so a tensor in layer i only reruns layers i..L-1;
- layer i runs once per candidate, then all candidates' outputs go through
  the shared suffix as one batch (``max_batch`` sequences at a time);
- every linear runs through mixbits kernels (``patch`` the model first).

Results are checkpointed atomically after every tensor; ``resume=True``
skips the tensors already in the file, and because each tensor is always
computed whole and in the same way, a resumed sweep equals an
uninterrupted one exactly.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..adapter import ModelAdapter, Site, dense_weight
from ..atomic import write_json_atomic
from .candidates import Candidate, build_layer, fitting, needs_inputs, parse_candidate
from ..formats.errors import load_json
from ..lock import locks_output
from .replay import Replayer, token_chunks

TABLE_FORMAT = "mixbits.sensitivity"
TABLE_VERSION = 1


def kl_per_token(ref_logits: mx.array, logits: mx.array) -> mx.array:
    """KL(P_ref || Q) per token, float32, over the last axis (the fused
    primitive; NaN or +inf logits raise instead of poisoning the table)."""
    from ..kl import kl_divergence

    return kl_divergence(ref_logits, logits)


def tokens_digest(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype=np.int64).tobytes()).hexdigest()[:16]


def token_settings(tokens=None, n_seq: int | None = None, seq_len: int | None = None) -> dict:
    """What a table or measurement records of its calibration tokens (and a
    resume must match): their digest and shape; before the tokens exist
    (cut from text after the model loads), the requested shape only."""
    if tokens is None:
        return {"n_sequences": n_seq, "seq_len": seq_len}
    tokens = np.asarray(tokens)
    return {"tokens_sha256_16": tokens_digest(tokens), "n_sequences": int(tokens.shape[0]),
            "seq_len": int(tokens.shape[1])}


@dataclass
class SweepConfig:
    candidates: list[str]
    max_batch: int = 8  # sequences per suffix forward (candidates x sequences)
    scale_dtype: object = mx.float16
    sites: list[str] | None = None  # restrict to these paths (default: all)


@dataclass
class SiteResult:
    site: Site
    kl: dict[str, float]
    kl_stderr: dict[str, float]
    storage_bits: dict[str, int]
    seconds: float
    candidates: dict[str, Candidate] = field(default_factory=dict)

    def to_entry(self) -> dict:
        cands = []
        for name, c in self.candidates.items():
            cands.append({
                "kind": name,
                "bits": c.nominal_bits,
                "kl": self.kl[name],
                "kl_stderr": self.kl_stderr[name],
                "storage_bits": self.storage_bits[name],
                "bpw": self.storage_bits[name] / self.site.nparams,
                "group_size": c.group_size,
            })
        entry = {"path": self.site.path}
        if self.site.block is not None:
            entry["layer"] = self.site.block
        return {
            **entry,
            "nparams": self.site.nparams,
            "shape": list(self.site.shape),
            "candidates": cands,
            "seconds": round(self.seconds, 3),
        }


def measure_site(rp: Replayer, site: Site, cands: list[Candidate], cfg: SweepConfig,
                 along=()) -> SiteResult:
    """KL of every candidate for one tensor; candidates share the suffix
    forward, ``cfg.max_batch`` sequences at a time. ``along``: the sites
    measured next whose inputs the same replay records
    (Replayer.input_hessian)."""
    t0 = time.perf_counter()
    original = rp.adapter.get(site.path)
    inputs = rp.input_hessian(site, along) if any(needs_inputs(c, site) for c in cands) else None
    layers, storage = [], {}
    dense = dense_weight(original)  # decoded once, shared by the candidates' builds
    for c in cands:
        layer = build_layer(original, c, cfg.scale_dtype, inputs, dense)
        layers.append(layer)
        storage[c.name] = storage_bits(layer, site)
    sums = {c.name: [] for c in cands}
    for ci, toks in enumerate(rp.chunks):
        b = toks.shape[0]
        per = max(1, cfg.max_batch // b)
        for j in range(0, len(cands), per):
            group = layers[j : j + per]
            logits = rp.candidate_logits(ci, site, group)
            # Each candidate's slice against the one reference: no copies
            # of the reference logits per candidate.
            for g in range(len(group)):
                kl = kl_per_token(rp.logits[ci], logits[g * b : (g + 1) * b])
                sums[cands[j + g].name].append(np.array(kl, dtype=np.float64).ravel())
    kl_mean, kl_se = {}, {}
    for name, parts in sums.items():
        v = np.concatenate(parts)
        kl_mean[name] = float(v.mean())
        kl_se[name] = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0
    from .. import streaming

    streaming.release(original)  # its weight, read for the candidates (a model on disk)
    return SiteResult(site, kl_mean, kl_se, storage, time.perf_counter() - t0,
                      {c.name: c for c in cands})


def storage_bits(layer, site: Site) -> int:
    """Exact storage bits of a quantized module's weight: codes, scales,
    biases and the permutation (not a float bias)."""
    from ..nn import MixedWeight, RowBandEmbedding

    if isinstance(layer, RowBandEmbedding):
        return layer.storage_bits()
    if isinstance(layer, MixedWeight):  # linears, embeddings and expert stacks
        return int(round(layer.quantized_tensor().bits_per_weight * site.nparams))
    return int(sum(layer[k].nbytes * 8 for k in ("weight", "scales", "biases") if k in layer))


def measure_site_naive(model, tokens: np.ndarray, site: Site, cand: Candidate,
                       cfg: SweepConfig, ref_logits: list[mx.array], chunk: int) -> float:
    """The slow baseline: one full forward per candidate, no reuse."""
    ad = ModelAdapter(model)
    original = ad.get(site.path)
    ad.set(site.path, build_layer(original, cand, cfg.scale_dtype))
    try:
        parts = []
        for ci, toks in enumerate(token_chunks(tokens, chunk)):
            logits = model(toks)
            parts.append(np.array(kl_per_token(ref_logits[ci], logits), dtype=np.float64).ravel())
        return float(np.concatenate(parts).mean())
    finally:
        ad.set(site.path, original)


def select_sites(adapter: ModelAdapter, paths: list[str] | None) -> list[Site]:
    """The adapter's tensors, or the named ones (unknown names refused)."""
    if paths is None:
        return list(adapter.sites)
    known = {s.path for s in adapter.sites}
    unknown = [p for p in paths if p not in known]
    if unknown:
        raise ValueError(f"unknown tensor paths {unknown[:5]}; this model's look like "
                         f"{[s.path for s in adapter.sites[:3]]}")
    return [s for s in adapter.sites if s.path in set(paths)]


def model_fingerprint(model) -> str:
    """Identity of a model's weights, cheap enough for any size: a hash of
    every parameter's name, shape and dtype, and of the first 64K values of
    three of its matrices (first, middle and last by name). Two loads of
    one model agree; another model, or the same one quantized or
    AWQ-scaled differently, almost surely does not."""
    from mlx.utils import tree_flatten

    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    h = hashlib.sha256()
    for k, v in params:
        h.update(f"{k}:{tuple(v.shape)}:{v.dtype};".encode())
    mats = [v for _, v in params if v.ndim >= 2] or [v for _, v in params]
    for v in {id(m): m for m in (mats[:1] + mats[len(mats) // 2:][:1] + mats[-1:])}.values():
        v = v.reshape(-1)[:65536]
        if mx.issubdtype(v.dtype, mx.floating):
            v = v.astype(mx.float32)  # numpy has no bfloat16; float32 holds every value
        h.update(np.array(v).tobytes())
    from .. import streaming

    streaming.release(model)  # the three matrices read above, when the weights stay on disk
    return h.hexdigest()[:16]


def settings_mismatch(path, prev_meta, meta, ignore=()) -> None:
    """Refuse to resume ``path`` (its table's ``prev_meta``) with other
    settings ``meta``: every key of either, except ``ignore`` (results such
    as timings), must be equal. The error names each differing setting
    with both values."""
    from ..errors import UsageError

    prev_meta = prev_meta if isinstance(prev_meta, dict) else {}
    keys = [k for k in {**prev_meta, **meta} if k not in ignore]
    diff = [k for k in keys if prev_meta.get(k) != meta.get(k)]
    if diff:
        def short(v):
            s = "absent" if v is None else json.dumps(v)
            return s if len(s) <= 60 else s[:57] + "..."

        said = "; ".join(f"{k}: {short(prev_meta.get(k))} in the file, {short(meta.get(k))} now"
                         for k in diff[:4])
        if all(k not in prev_meta for k in diff):  # e.g. no fingerprint: an older mixbits wrote it
            raise UsageError(f"{path} does not record all the settings a resume must match ({said}): "
                             "an older mixbits wrote it, or another tool; choose another --out")
        raise UsageError(f"{path} was made with different settings ({said}); resume it with the "
                         "same settings or choose another --out")


def table_meta(tokens, cfg, model_id, sites, *, model=None, method: str = "exact") -> dict:
    """The settings a table records (and a resumed sweep must match):
    the method, the model (its ``model_fingerprint`` when ``model`` is
    given), the tokens, candidates (quantizer suffixes included) and tensors."""
    return {
        "method": method,
        "model": model_id,
        **({"model_fingerprint": model_fingerprint(model)} if model is not None else {}),
        **token_settings(tokens),
        "candidates": list(cfg.candidates),
        "scale_dtype": str(cfg.scale_dtype).replace("mlx.core.", ""),
        "sites": [s.path for s in sites],
    }


@locks_output
def sweep(model, tokens, out: str | Path, candidates=None, *, resume: bool = False,
           model_id: str = "", max_batch: int = 8, sites: list[str] | None = None,
           rank: int = 0, world: int = 1, progress: bool = True, on_site=None) -> dict:
    """Measure every (tensor, candidate) of ``model`` on ``tokens`` [B, T].

    Writes the sensitivity table to ``out`` after every tensor (atomic),
    holding ``out``'s lock (:func:`mixbits.lock.output_lock`) throughout:
    a second sweep into the same file is refused. With ``world > 1`` this
    process measures every ``world``-th tensor starting at ``rank`` (see
    :mod:`mixbits.measure.distributed`). Returns the table dict.
    """
    from tqdm import tqdm

    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [sequences, length>=2], got shape {tokens.shape}")
    cfg = SweepConfig(list(candidates or []), max_batch=max_batch, sites=sites)
    if not cfg.candidates:
        raise ValueError("at least one candidate is required")
    cands = [parse_candidate(c) for c in cfg.candidates]
    adapter = ModelAdapter(model)
    all_sites = select_sites(adapter, sites)
    site_cands, left_float = fitting(all_sites, cands)  # refuses now if nothing fits
    all_sites = [s for s in all_sites if s.path in site_cands]
    meta = table_meta(tokens, cfg, model_id, all_sites, model=model)
    mine = all_sites[rank::world]
    out = Path(out)
    done: dict[str, dict] = {}
    if out.exists():
        if not resume:
            raise FileExistsError(f"{out} exists; pass resume=True (--resume) to continue it")
        prev = load_json(out, "sweep checkpoint")
        settings_mismatch(out, prev.get("meta"), meta)
        done = {e["path"]: e for e in prev.get("entries", [])}
    todo = [s for s in mine if s.path not in done]
    chunk = max(1, min(len(tokens), max_batch))
    rp = Replayer(model, token_chunks(tokens, chunk), adapter) if todo else None

    def table(complete: bool) -> dict:
        entries = [done[s.path] for s in all_sites if s.path in done]
        return {"format": TABLE_FORMAT, "version": TABLE_VERSION, "metric": "kl",
                "meta": meta, "complete": complete, "entries": entries,
                **({"float": left_float} if left_float else {})}

    bar = tqdm(total=sum(len(site_cands[s.path]) for s in mine),
               initial=sum(len(site_cands[s.path]) for s in mine if s.path in done),
               unit="cand", desc=f"sweep{'' if world == 1 else f' rank {rank}'}",
               disable=not progress, smoothing=0.1)
    along = [s for s in todo if any(needs_inputs(c, s) for c in site_cands[s.path])]
    for site in todo:
        res = measure_site(rp, site, site_cands[site.path], cfg, along)
        done[site.path] = res.to_entry()
        write_json_atomic(table(complete=False), out, indent=1)
        bar.update(len(site_cands[site.path]))
        if on_site:
            on_site(res)
    bar.close()
    result = table(complete=all(s.path in done for s in mine))
    write_json_atomic(result, out, indent=1)
    return result
