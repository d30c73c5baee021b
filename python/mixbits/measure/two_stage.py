"""Sensitivity tables by gradient proxy (``grad``) or proxy + exact
(``two-stage``), in the layout the exact sweep writes.

Two-stage spends a fixed share of an exact sweep's cost (``budget``) where
the allocator's decisions depend on it, in ``rounds`` rounds (default 3):

1. Calibrate. Each candidate kind gets its own scale, the median
   exact/proxy ratio (in logs) of its exactly measured pairs; a kind with no
   measured pair takes the median over all pairs (1 before any). The
   proxy's error sigma is the robust spread of the same logs
   (:func:`proxy_sigma`; SIGMA0 before MIN_PAIRS pairs).
2. Solve. For each target bpw, the knapsack on the table (exact values where
   measured, calibrated proxy elsewhere). At the optimum the multiplier nu
   prices a bit in KL; the trade between a tensor's choice j and another
   candidate k lies |log(rate / nu)| from the boundary, which a proxy error
   of that size could cross: in units of the error, divided by sigma x
   sqrt(how many of j, k are still proxy values). The nearest such k is the
   rival; a trade measured on both sides is settled.
3. Measure, nearest the boundary (in those units) first, the pairs
   (tensor, j) and (tensor, k) not measured yet -- not the tensor's other
   candidates -- until the round's share of the budget is spent; then back to 1.

Cost is counted in forwards: an exact pair replays the model from its
tensor's block to the output, ``blocks - block + 1`` block forwards (the +1
is the output head; a tensor outside the blocks counts a full forward);
``budget`` is the share of the same count over every (tensor, candidate)
pair, i.e. of a full exact sweep. In bench/grad_cost.py's SmolLM2-135M run
0.1475 of the count took about 0.14 of the exact sweep's CPU time (two-stage
100 CPU s, of which its grad stage about 30, vs 487).

Why this rule (SmolLM2-135M, 4 candidates, 1 x 256 calibration tokens,
simulated from saved exact and proxy tables, allocations scored on 8 x 256
held-out design tokens; bench/README.md has the numbers): the old rule --
20% of tensors nearest the boundary, all their candidates, one global
scale -- spent 0.25 of the exact cost for +7% joint KL at 3.5 bpw. Pairs
instead of whole tensors and a cost budget buy more decisions for the same
cost. Ranking in units of the observed proxy error (half-measured trades
are less uncertain) with 3 rounds took the design tokens' 3.5 bpw gap from
+3.3% (raw distance, 2 rounds) to +0.1% at the same 0.15 budget; on 265
held-out sequences see bench/README.md.

Every candidate records its ``source`` ("exact" or "grad"). Nothing
done is lost to a kill: the grad stage checkpoints each rated tensor to
``<out>`` itself (``"complete": false``, its state under
``grad_stage``) and the Fisher pass's block chain after each finished
block to ``<out>.fisher.safetensors`` (the cotangents at that block's
input), so a resumed run rates no tensor twice and takes the backward on
from the lowest finished block; the exact stage checkpoints each measured
tensor to ``<out>.exact.json``, and a resumed run reuses those pairs and
counts them against the budget. A resume with other settings (model,
tokens, candidates, samples, seed, method options) is refused before any
work.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import numpy as np

from ..alloc import solve
from ..atomic import write_json_atomic
from ..lock import locks_output
from .refine import table_problem
from .sweep import (TABLE_FORMAT, TABLE_VERSION, SweepConfig, select_sites, settings_mismatch,
                    table_meta)

ROUNDS = 3
# meta keys that are results of a run, not settings a resume must match
RESULTS = ("proxy_seconds", "proxy_bias", "exact_seconds", "exact_pairs", "exact_tensors", "exact_cost_share",
           "proxy_scales", "proxy_scale_overall")
SIGMA0, MIN_PAIRS = 0.3, 8  # the proxy's error in log KL before 8 pairs are measured


def kind_scales(entries: list[dict], exact: dict[str, dict[str, float]]) -> tuple[dict, float]:
    """({candidate kind: exact/proxy scale}, scale of all kinds together):
    medians of log(exact / proxy) over the measured pairs (``exact``:
    {path: {kind: kl}}); 1.0 where nothing is measured."""
    logs: dict[str, list[float]] = {}
    for e in entries:
        ex = exact.get(e["path"], {})
        for c in e["candidates"]:
            if ex.get(c["kind"], 0) > 0 and c["kl"] > 0 and c.get("source") != "exact":
                logs.setdefault(c["kind"], []).append(math.log(ex[c["kind"]] / c["kl"]))
    pooled = [v for vs in logs.values() for v in vs]
    overall = math.exp(float(np.median(pooled))) if pooled else 1.0
    return {k: math.exp(float(np.median(v))) for k, v in logs.items()}, overall


def merge(entries: list[dict], exact: dict[str, dict[str, float]]) -> list[dict]:
    """Proxy entries with the measured pairs' exact KLs and the others'
    proxy KLs times their kind's scale (see :func:`kind_scales`)."""
    scales, overall = kind_scales(entries, exact)
    out = []
    for e in entries:
        ex = exact.get(e["path"], {})
        cands = [{**c, "kl": ex[c["kind"]], "source": "exact"} if c["kind"] in ex else
                 {**c, "kl": c["kl"] * scales.get(c["kind"], overall), "source": "grad"}
                 for c in e["candidates"]]
        out.append({**e, "candidates": cands})
    return out


def proxy_sigma(entries: list[dict], exact: dict[str, dict[str, float]]) -> float:
    """The proxy's observed error: robust standard deviation (1.4826 x
    median absolute deviation) of log(exact / (proxy x kind scale)) over
    the measured pairs; SIGMA0 with fewer than MIN_PAIRS of them."""
    scales, overall = kind_scales(entries, exact)
    r = [math.log(exact[e["path"]][c["kind"]] / (c["kl"] * scales.get(c["kind"], overall)))
         for e in entries for c in e["candidates"]
         if exact.get(e["path"], {}).get(c["kind"], 0) > 0 and c["kl"] > 0
         and c.get("source") != "exact"]  # a proxy fallback's pairs have no proxy value
    if len(r) < MIN_PAIRS:
        return SIGMA0
    return max(1.4826 * float(np.median(np.abs(np.array(r) - np.median(r)))), 1e-6)


def decisions(table: dict, targets, exact: dict[str, dict[str, float]] | None = None,
              sigma: float = 1.0) -> list[tuple[float, str, str, str]]:
    """(distance, path, chosen kind, rival kind) for every tensor at every
    target bpw, nearest the allocator's decision boundary first. The trade
    between the tensor's choice j and a candidate k is |log(rate / nu)|
    away from the boundary, in units of its error: ``sigma`` (the proxy's
    error in log KL) x sqrt(how many of j and k are not in ``exact``); the
    rival is the nearest k in those units. A trade both of whose sides
    are measured has no error and is never a rival; a tensor without one
    is left out."""
    prob = table_problem(table)
    exact = exact or {}
    out = []
    for bpw in targets:
        sol = solve(prob, prob.budget_from_bpw(bpw))
        nu = max(float(sol.nu), 1e-30)
        for i, (w, c) in enumerate(zip(prob.weights, prob.costs)):
            j = int(sol.choice[i])
            kinds = [x["kind"] for x in table["entries"][i]["candidates"]]
            ex = exact.get(prob.names[i], {})
            best = None
            for k in range(len(w)):
                unmeasured = (kinds[j] not in ex) + (kinds[k] not in ex)
                if w[k] != w[j] and unmeasured:
                    rate = max(abs(c[k] - c[j]) / abs(w[k] - w[j]), 1e-30)
                    d = abs(math.log(rate / nu)) / (sigma * math.sqrt(unmeasured))
                    if best is None or d < best[0]:
                        best = (d, k)
            if best is not None:
                out.append((best[0], prob.names[i], kinds[j], kinds[best[1]]))
    out.sort()
    return out


def pair_costs(entries: list[dict]) -> dict[str, int]:
    """{path: block forwards one exact (tensor, candidate) measurement
    replays}: from the tensor's block to the output, plus one for the head;
    a tensor outside the blocks (embedding, head) counts a full forward."""
    blocks = 1 + max((e["layer"] for e in entries if e.get("layer") is not None), default=0)
    return {e["path"]: blocks - e["layer"] + 1 if e.get("layer") is not None else blocks + 1
            for e in entries}


def plan(entries: list[dict], exact: dict[str, dict[str, float]], targets, quota: float,
         cost: dict[str, int]) -> list[tuple[str, str]]:
    """The next (path, kind) pairs to measure: the unmeasured pairs of the
    decisions nearest the boundary (see :func:`decisions`) on the table
    calibrated with ``exact``, while their cost fits in ``quota``."""
    table = {"entries": merge(entries, exact)}
    new: list[tuple[str, str]] = []
    for _, path, kj, kk in decisions(table, targets, exact, proxy_sigma(entries, exact)):
        add = [(path, k) for k in (kj, kk) if k not in exact.get(path, {}) and (path, k) not in new]
        c = cost[path] * len(add)
        if c > quota:
            break
        quota -= c
        new += add
    return new


# Beside a table: the gradient pass's block chain state (see grad.GradCheckpoint).
FISHER_STATE = ".fisher.safetensors"


def settings_key(settings: dict) -> str:
    """A digest of a run's settings, which tags the state files it leaves."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def grad_stage(path, table: dict) -> dict:
    """What an unfinished table (a grad stage killed part way) holds for a
    resume: {"entries": {path: entry}, "fallback": {path: why},
    "fisher_pass", "seconds"}; {} for a table without it (an older run's)."""
    from ..errors import FormatError

    st = table.get("grad_stage")
    if st is None:
        return {}
    entries = table.get("entries")
    if (not isinstance(st, dict) or not isinstance(entries, list)
            or not all(isinstance(e, dict) and isinstance(e.get("path"), str) for e in entries)
            or not isinstance(st.get("fallback", {}), dict)
            or st.get("fisher_pass") not in (None, "blocks", "whole")):
        raise FormatError(f"{path}: its unfinished gradient stage is not one mixbits wrote; choose "
                          "another --out")
    return {"entries": {e["path"]: e for e in entries}, "fallback": dict(st.get("fallback", {})),
            "fisher_pass": st.get("fisher_pass"), "seconds": float(st.get("seconds", 0.0))}


@locks_output
def proxy_sweep(model, tokens, out, candidates, *, method: str = "grad", sites=None,
                targets=(3.0, 3.5, 4.0, 4.5), budget: float = 0.15, rounds: int = ROUNDS,
                samples: int = 2, seed: int = 0, max_batch: int = 8, model_id: str = "",
                resume: bool = False, progress: bool = True) -> dict:
    """Write and return a sensitivity table by ``method`` "grad" or
    "two-stage" (``budget``: the exact stage's share of a full exact
    sweep's cost, spent over ``rounds`` rounds; see the module docstring).
    Holds ``out``'s lock (one writer) throughout."""
    from ..adapter import ModelAdapter
    from ..formats.errors import load_json
    from .candidates import fitting, needs_inputs, parse_candidate
    from .grad import POSITION_CLIP, GradCheckpoint, grad_entries
    from .replay import Replayer, token_chunks
    from .sweep import measure_site

    if method not in ("grad", "two-stage"):
        raise ValueError(f"method must be 'grad' or 'two-stage', got {method!r}")
    if not 0 < budget <= 1:
        raise ValueError(f"budget must be in (0, 1], got {budget}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if method == "two-stage" and not targets:
        raise ValueError("two-stage needs at least one target bpw")
    tokens = np.asarray(tokens)
    out = Path(out)
    if out.exists() and not resume:
        raise FileExistsError(f"{out} exists; pass resume=True (--resume) to continue it")
    cands = [parse_candidate(c) for c in candidates]
    adapter = ModelAdapter(model)
    all_sites = select_sites(adapter, sites)
    site_cands, left_float = fitting(all_sites, cands)  # refuses now if nothing fits
    all_sites = [s for s in all_sites if s.path in site_cands]
    meta = table_meta(tokens, SweepConfig(list(candidates)), model_id, all_sites, model=model,
                      method=method)
    meta.update({"fisher_samples": samples, "seed": seed, "fisher_position_clip": POSITION_CLIP})
    if method == "two-stage":
        meta.update({"targets_bpw": list(targets), "exact_budget": budget, "rounds": rounds})
    settings = dict(meta)  # what a resume must match; results are added below
    stage: dict = {}
    if out.exists():  # resume: only a table made with these settings (not an exact one, say)
        prev = load_json(out, "sensitivity table")
        settings_mismatch(out, prev.get("meta"), settings, ignore=RESULTS)
        if prev.get("complete") is True:
            return prev  # finished: the same settings give the same table
        stage = grad_stage(out, prev)
    side = out.with_name(out.name + ".exact.json")  # the exact stage's own checkpoint
    done: dict[str, dict] = {}
    if method == "two-stage" and side.exists():  # checked before any work, as the table is
        if not resume:
            raise FileExistsError(f"{side} exists; pass resume=True (--resume) to continue it")
        prev = load_json(side, "two-stage exact checkpoint")
        settings_mismatch(side, prev.get("meta"), settings)
        done = {e["path"]: e for e in prev.get("entries", [])}
    t0 = time.perf_counter()
    before = stage.get("seconds", 0.0)  # the grad stage's time in the runs before this one

    def save(entries, state):
        # The grad stage's checkpoint is the table itself, unfinished: a resume reads it back.
        write_json_atomic({"format": TABLE_FORMAT, "version": TABLE_VERSION, "metric": "kl",
                           "meta": settings, "complete": False, "entries": entries,
                           "grad_stage": {**state, "seconds": round(before + time.perf_counter() - t0, 3)},
                           **({"float": left_float} if left_float else {})}, out, indent=1)

    ck = GradCheckpoint(save, out.with_name(out.name + FISHER_STATE), settings_key(settings),
                        entries=stage.get("entries", {}), fallback=stage.get("fallback", {}),
                        fisher_pass=stage.get("fisher_pass"))
    entries = grad_entries(model, tokens, all_sites, site_cands, samples=samples, seed=seed,
                           progress=progress, checkpoint=ck)
    meta["proxy_seconds"] = round(before + time.perf_counter() - t0, 3)
    cap = getattr(getattr(model, "args", None), "final_logit_softcapping", None)
    if cap:  # the table says where its proxy values can be off in scale
        # Issue 40 item 4 (tests/test_proxy_scale.py): the proxy is the second-order term of
        # the capped logits' KL (exact/proxy ~1 on tiny gemma2s, cap saturated or not; the
        # 16x of issue 43 did not reproduce); only a cap saturated far past c (94% of the
        # pre-cap logits beyond c/2) made 2-bit errors' KL grow faster, up to 2-3x the proxy.
        meta["proxy_bias"] = (f"final logits soft-capped at {cap}: where the cap saturates, the "
                              "KL of large (2-bit) errors grows faster than the Fisher proxy's "
                              "quadratic, which can run low (tiny gemma2: up to 2-3x; ~1x "
                              "unsaturated); "
                              + ("exact pairs rescale it per kind" if method == "two-stage"
                                 else "use --method two-stage or exact for KL values"))
    table = {"format": TABLE_FORMAT, "version": TABLE_VERSION, "metric": "kl", "meta": meta,
             "complete": True, "entries": entries, **({"float": left_float} if left_float else {})}
    if method == "two-stage":
        t1 = time.perf_counter()
        side_meta = settings
        exact = {p: {c["kind"]: c["kl"] for c in e["candidates"]} for p, e in done.items()}
        cost = pair_costs(entries)
        total = sum(cost[e["path"]] * len(e["candidates"]) for e in entries)
        spent = sum(cost[p] * len(ks) for p, ks in exact.items())
        for e in entries:  # tensors the proxy could not rate, measured exactly (not in the budget)
            if "proxy_fallback" in e:
                exact.setdefault(e["path"], {}).update({c["kind"]: c["kl"] for c in e["candidates"]})
        by_site = {s.path: s for s in all_sites}
        cfg = SweepConfig(list(candidates), max_batch=max_batch)
        rp = None
        from tqdm import tqdm

        # Progress in the budget's own unit (block forwards), so the ETA is the stage's.
        bar = tqdm(total=round(budget * total), initial=min(round(spent), round(budget * total)),
                   desc="exact stage", unit="fwd", disable=not progress, smoothing=0.1)
        for r in range(rounds):
            quota = budget * total * (r + 1) / rounds - spent
            todo: dict[str, list[str]] = {}
            for path, kind in plan(entries, exact, targets, quota, cost):
                todo.setdefault(path, []).append(kind)
            # the round's calibrated linears: a block's inputs recorded in one replay
            along = [by_site[p] for p, kinds in todo.items()
                     if any(needs_inputs(c, by_site[p]) for c in site_cands[p] if c.name in kinds)]
            for path, kinds in todo.items():
                if rp is None:
                    chunk = max(1, min(len(tokens), max_batch))
                    rp = Replayer(model, token_chunks(tokens, chunk), adapter)
                site = by_site[path]
                res = measure_site(rp, site, [c for c in site_cands[path] if c.name in kinds], cfg, along)
                got = res.to_entry()
                old = done.get(path, {**got, "candidates": [], "seconds": 0.0})
                done[path] = {**got, "candidates": old["candidates"] + got["candidates"],
                              "seconds": round(old["seconds"] + got["seconds"], 3)}
                exact.setdefault(path, {}).update({c["kind"]: c["kl"] for c in got["candidates"]})
                spent += cost[path] * len(kinds)
                bar.update(min(cost[path] * len(kinds), bar.total - bar.n))
                write_json_atomic({"format": TABLE_FORMAT, "version": TABLE_VERSION,
                                   "metric": "kl", "meta": side_meta, "complete": False,
                                   "entries": list(done.values())}, side, indent=1)
        bar.close()
        scales, overall = kind_scales(entries, exact)
        table["entries"] = merge(entries, exact)
        meta.update({"exact_pairs": sum(len(v) for v in exact.values()),
                     "exact_tensors": len(exact), "exact_cost_share": round(spent / total, 4),
                     "proxy_scales": scales, "proxy_scale_overall": overall,
                     "exact_seconds": round(time.perf_counter() - t1, 3)})
    write_json_atomic(table, out, indent=1)
    return table
