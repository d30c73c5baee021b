"""Sensitivity tables by gradient proxy (``grad``) or proxy + exact
(``two-stage``), in the layout the exact sweep writes.

Two-stage decides where exactness matters by asking the allocator. For
each target bpw it solves the knapsack on the proxy table; at the optimum
the multiplier nu prices a bit in KL, and every tensor's neighbouring
candidates trade KL for bits at some rate. A tensor whose best trade is
close to nu (|log(rate / nu)| small) sits on the decision boundary: a
proxy error of a small factor could flip its choice. The ``fraction`` of
tensors nearest the boundary at any target are measured exactly (all their
candidates); the rest keep their proxy KLs, rescaled by the median
exact/proxy ratio of the measured ones so the two sources share one scale.
Every candidate records its ``source`` ("exact" or "grad").
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from ..alloc import solve
from ..atomic import write_json_atomic
from .refine import table_problem
from .sweep import TABLE_FORMAT, TABLE_VERSION, SweepConfig, select_sites, sweep, table_meta


def borderline(table: dict, targets, fraction: float) -> list[str]:
    """Paths of the tensors nearest the allocator's decision boundary."""
    prob = table_problem(table)
    picked: list[str] = []
    take = max(1, math.ceil(fraction * prob.n_slots))
    for bpw in targets:
        sol = solve(prob, prob.budget_from_bpw(bpw))
        nu = max(float(sol.nu), 1e-30)
        scores = []
        for i, (w, c) in enumerate(zip(prob.weights, prob.costs)):
            j = int(sol.choice[i])
            rates = [abs(c[k] - c[j]) / abs(w[k] - w[j]) for k in range(len(w)) if w[k] != w[j]]
            d = min((abs(math.log(max(r, 1e-30) / nu)) for r in rates), default=math.inf)
            scores.append((d, i))
        for _, i in sorted(scores)[:take]:
            if prob.names[i] not in picked:
                picked.append(prob.names[i])
    return picked


def proxy_sweep(model, tokens, out, candidates, *, method: str = "grad", sites=None,
                targets=(3.0, 3.5, 4.0, 4.5), fraction: float = 0.2, samples: int = 2,
                seed: int = 0, max_batch: int = 8, model_id: str = "", resume: bool = False,
                progress: bool = True) -> dict:
    """Write and return a sensitivity table by ``method`` "grad" or "two-stage"."""
    from ..adapter import ModelAdapter
    from .candidates import parse_candidate, supports
    from .grad import grad_entries

    if method not in ("grad", "two-stage"):
        raise ValueError(f"method must be 'grad' or 'two-stage', got {method!r}")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    tokens = np.asarray(tokens)
    out = Path(out)
    if out.exists() and not resume:
        raise FileExistsError(f"{out} exists; pass resume=True (--resume) to continue it")
    cands = [parse_candidate(c) for c in candidates]
    adapter = ModelAdapter(model)
    all_sites = select_sites(adapter, sites)
    site_cands = {s.path: [c for c in cands if supports(c, s)] for s in all_sites}
    t0 = time.perf_counter()
    entries = grad_entries(model, tokens, all_sites, site_cands, samples=samples, seed=seed,
                           progress=progress)
    meta = table_meta(tokens, SweepConfig(list(candidates)), model_id, all_sites)
    meta.update({"method": method, "fisher_samples": samples, "seed": seed,
                 "proxy_seconds": round(time.perf_counter() - t0, 3)})
    table = {"format": TABLE_FORMAT, "version": TABLE_VERSION, "metric": "kl", "meta": meta,
             "complete": True, "entries": entries}
    if method == "two-stage":
        exact_paths = borderline(table, targets, fraction)
        side = out.with_name(out.name + ".exact.json")  # the exact stage's own resumable checkpoint
        t1 = time.perf_counter()
        exact = sweep(model, tokens, side, candidates, resume=resume and side.exists(),
                      model_id=model_id, max_batch=max_batch, sites=exact_paths, progress=progress)
        exact_by = {e["path"]: e for e in exact["entries"]}
        ratios = [ce["kl"] / cp["kl"]
                  for e in entries if e["path"] in exact_by
                  for cp, ce in zip(e["candidates"], exact_by[e["path"]]["candidates"])
                  if cp["kl"] > 0 and ce["kl"] > 0]
        scale = float(np.median(ratios)) if ratios else 1.0
        merged = []
        for e in entries:
            if e["path"] in exact_by:
                x = exact_by[e["path"]]
                merged.append({**x, "candidates": [{**c, "source": "exact"} for c in x["candidates"]]})
            else:
                merged.append({**e, "candidates": [{**c, "kl": c["kl"] * scale} for c in e["candidates"]]})
        table["entries"] = merged
        meta.update({"targets_bpw": list(targets), "exact_fraction": fraction,
                     "exact_tensors": len(exact_paths), "proxy_scale": scale,
                     "exact_seconds": round(time.perf_counter() - t1, 3)})
    write_json_atomic(table, out, indent=1)
    return table
