"""Sharding a sweep over processes or hosts with MLX's distributed layer.

Start it with ``mlx.launch`` (e.g. ``mlx.launch --backend ring -n 2 --
mixbits measure ...``). Rank r measures tensors r, r+world, ... into its own
checkpoint ``<out>.rank<r>-of-<world>.json`` (each resumable on its own);
at the end the parts are exchanged with ``all_gather`` (no shared disk is
needed) and rank 0 writes the merged table to ``<out>``. Every tensor is
computed exactly as a single process computes it, so the merged table
equals a one-process sweep.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..atomic import write_json_atomic


def group():
    """The distributed group, or None when running alone."""
    if not mx.distributed.is_available():
        return None
    g = mx.distributed.init()
    return g if g.size() > 1 else None


def part_path(out, rank: int, world: int) -> Path:
    out = Path(out)
    return out.with_name(f"{out.stem}.rank{rank}-of-{world}{out.suffix}")


def gather_bytes(payload: bytes, g) -> list[bytes]:
    """All ranks' byte strings, in rank order, on every rank."""
    n = mx.distributed.all_gather(mx.array([len(payload)], dtype=mx.int32), group=g)
    sizes = [int(v) for v in np.array(n)]
    width = max(sizes)
    buf = np.zeros(width, dtype=np.uint8)
    buf[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    allb = np.array(mx.distributed.all_gather(mx.array(buf), group=g)).reshape(len(sizes), width)
    return [allb[r, : sizes[r]].tobytes() for r in range(len(sizes))]


def merge_tables(parts: list[dict]) -> dict:
    """One table from the ranks' partial tables, entries in sweep order."""
    meta = parts[0]["meta"]
    for p in parts[1:]:
        if p["meta"] != meta:
            raise ValueError("ranks disagree on the sweep settings; refusing to merge")
    by_path = {e["path"]: e for p in parts for e in p["entries"]}
    entries = [by_path[s] for s in meta["sites"] if s in by_path]
    out = dict(parts[0])
    out["entries"] = entries
    out["complete"] = len(entries) == len(meta["sites"])
    return out


def sharded_sweep(model, tokens, out, candidates, *, resume=False, **kw) -> dict | None:
    """Run this rank's share and merge; returns the merged table on rank 0."""
    from .sweep import sweep

    g = group()
    if g is None:
        return sweep(model, tokens, out, candidates, resume=resume, **kw)
    rank, world = g.rank(), g.size()
    mine = sweep(model, tokens, part_path(out, rank, world), candidates, resume=resume,
                 rank=rank, world=world, **kw)
    parts = [json.loads(b) for b in gather_bytes(json.dumps(mine).encode(), g)]
    merged = merge_tables(parts)
    if rank == 0:
        from ..lock import output_lock

        with output_lock(out):
            write_json_atomic(merged, out, indent=1)
        return merged
    return None
