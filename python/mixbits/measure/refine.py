"""From a sensitivity table to an allocation.json: the exact knapsack
optimum of summed per-tensor KL under a bits budget, then swaps (one
tensor up, another down, budget kept) kept only when they lower the
*measured* joint KL on the calibration set.

Per-tensor KL need not be additive: several damaged tensors can hurt
together more than the sum of their KLs says. So before the swaps,
refinement also solves the knapsack on KL**p for a few p > 1 (which weighs
one large KL above several small ones of the same sum) and starts from
whichever of these optima has the lowest *measured* joint KL; every start
costs one evaluation out of ``max_evals``. On SmolLM2-135M with 4,096
calibration tokens the sum tracked the joint KL closely (0.926 vs 0.949 at
3.5 bpw) and a p > 1 start won only at 3.63 bpw (0.799 vs 0.813); on 256
tokens the per-tensor KLs were noisy enough that the plain optimum lost to
uniform 3-bit.

Budgets count storage bits by default (codes plus fp16 scales and biases,
as mlx-lm counts bits per weight: 4-bit g64 = 4.5 bpw); ``count="nominal"``
counts ``nparams * bits`` as allocation.json's ``average_bits`` does.
"""

from __future__ import annotations

import math

import numpy as np

from ..alloc import MCKProblem, solve


def option_bits(c: dict, nparams: int, count: str) -> int:
    """A candidate entry's bits in the budget's count ("storage" or "nominal")."""
    if count == "storage":
        if "storage_bits" not in c:
            raise ValueError(f"candidate {c.get('kind')!r} has no storage_bits; use count='nominal'")
        return int(c["storage_bits"])
    return int(round(float(c["bits"]) * nparams))


def table_problem(table: dict, count: str = "storage") -> MCKProblem:
    entries = table["entries"]
    if not entries:
        raise ValueError("the sensitivity table has no entries")
    weights = [[option_bits(c, e["nparams"], count) for c in e["candidates"]] for e in entries]
    costs = [[float(c["kl"]) for c in e["candidates"]] for e in entries]
    return MCKProblem(weights, costs, [e["path"] for e in entries], [e["nparams"] for e in entries])


def _entry(e: dict, c: dict) -> dict:
    bits = c["bits"]
    layer = {"layer": e["layer"]} if e.get("layer") is not None else {}
    return {"path": e["path"], **layer, "nparams": e["nparams"],
            "bits": int(bits) if float(bits).is_integer() else bits, "kind": c["kind"],
            "kl": c["kl"], "storage_bits": c.get("storage_bits")}


def without_outside(table: dict) -> dict:
    """The table less its embeddings and head (entries outside the
    blocks: no layer), for allocations that put them at ``embed_bits``
    outside the budget."""
    kept = [e for e in table["entries"] if e.get("layer") is not None]
    if not kept:
        raise ValueError("--embed-bits leaves no tensor to allocate: every entry of the table is an "
                         "embedding or head (no layer)")
    return {**table, "entries": kept}


def restrict_table(table: dict, kinds) -> dict:
    """The table with only the candidates named in ``kinds`` (one menu of a
    measurement over a superset, as convert refines with each of its
    menus), in the table's order; a tensor none of them was measured for
    leaves the table (it stays float, as a measurement with that menu
    alone leaves it) and is listed under "float"."""
    kinds = set(kinds)
    kept, left = [], []
    for e in table["entries"]:
        cands = [c for c in e["candidates"] if c["kind"] in kinds]
        if cands:
            kept.append({**e, "candidates": cands})
        else:
            left.append({"path": e["path"], "reason": "no candidate of the menu was measured for it"})
    if not kept:
        raise ValueError(f"no tensor of the table was measured with any of {sorted(kinds)}")
    out = {**table, "entries": kept}
    if left:
        out["float"] = list(table.get("float", [])) + left
    return out


def chosen_embed_bits(table: dict, assign: list[dict], embed_bits: int | None) -> int | None:
    """What allocation.json's embed_bits must say: ``embed_bits`` when
    embeddings and head were set apart at that width; else the width the
    allocation gave them (all the same integer width), else the table's
    own (embeddings it did not measure), else None (not one width)."""
    if embed_bits is not None:
        return int(embed_bits)
    from ..formats.allocation import EMBED_BITS

    outside = {float(a["bits"]) for a in assign if a.get("layer") is None}
    if len(outside) == 1:
        b = outside.pop()
        return int(b) if b.is_integer() and int(b) in EMBED_BITS else None
    if not outside:
        return table.get("embed_bits")
    return None


def allocation_from_choice(table: dict, choice, low_avg: float | None, high_avg: float,
                           count: str, embed_bits: int | None = None) -> dict:
    entries = table["entries"]
    assign = [_entry(e, e["candidates"][j]) for e, j in zip(entries, choice)]
    total = sum(a["nparams"] for a in assign)
    avg = sum(a["nparams"] * float(a["bits"]) for a in assign) / total
    out = {
        "average_bits": avg,
        "embed_bits": chosen_embed_bits(table, assign, embed_bits),
        "budget": {"low_avg": low_avg, "high_avg": high_avg, "count": count},
        "sum_kl": math.fsum(a["kl"] for a in assign),
        "dp_sum_kl": None,
        "assignment": assign,
    }
    if all(a["storage_bits"] is not None for a in assign):
        out["average_bpw_storage"] = sum(a["storage_bits"] for a in assign) / total
    return out


def allocate_table(table: dict, high_avg: float, low_avg: float | None = None,
                   count: str = "storage", embed_bits: int | None = None):
    """Exact optimum of summed KL with low_avg <= bits/weight <= high_avg.
    ``embed_bits``: embeddings and head leave the table and the budget,
    stored at that width (allocation.json's embed_bits)."""
    if embed_bits is not None:
        table = without_outside(table)
    prob = table_problem(table, count)
    total = int(prob.nparams.sum())
    budget = int(math.floor(high_avg * total))
    lower = None if low_avg is None else int(math.ceil(low_avg * total))
    sol = solve(prob, budget, lower)
    alloc = allocation_from_choice(table, sol.choice, low_avg, high_avg, count, embed_bits)
    alloc["dp_sum_kl"] = sol.cost
    return alloc, sol, prob


def _moves(prob: MCKProblem, choice, total_bits, budget, lower):
    """Candidate swaps: slot a to its next option with more bits and less
    KL, slot b to its next option with fewer bits; predicted change of
    summed KL, most promising first."""
    ups, downs = [], []
    for i, (w, c) in enumerate(zip(prob.weights, prob.costs)):
        j = choice[i]
        more = [k for k in range(len(w)) if w[k] > w[j] and c[k] < c[j]]
        if more:
            k = min(more, key=lambda k: (w[k], c[k]))
            ups.append((i, k, int(w[k] - w[j]), float(c[k] - c[j])))
        fewer = [k for k in range(len(w)) if w[k] < w[j]]
        if fewer:
            k = max(fewer, key=lambda k: (w[k], -c[k]))
            downs.append((i, k, int(w[k] - w[j]), float(c[k] - c[j])))
    out = []
    for a, ka, dwa, dca in ups:
        for b, kb, dwb, dcb in downs:
            if a == b:
                continue
            nb = total_bits + dwa + dwb
            if nb <= budget and (lower is None or nb >= lower):
                out.append((dca + dcb, a, ka, b, kb, nb))
    out.sort(key=lambda t: t[0])
    return out


def _powered(prob: MCKProblem, p: float) -> MCKProblem:
    return MCKProblem(prob.weights, [np.maximum(c, 0.0) ** p for c in prob.costs],
                      prob.names, prob.nparams)


def refine(table: dict, evaluator, high_avg: float, low_avg: float | None = None,
           count: str = "storage", max_evals: int = 30, calibration_ids=None,
           progress: bool = True, powers=(1.5, 2.0), method: str = "swaps", seed: int = 0,
           check_baselines: bool = True, embed_bits: int | None = None) -> dict:
    """Allocation dict (allocation.json layout) after joint-KL search.

    ``check_baselines``: also score uniform quantization and mlx-lm's mixed
    recipe within the budget (:func:`mixbits.measure.baselines.guard`, 1-3
    evaluations outside ``max_evals``); if one scores a lower joint KL than
    the search's result, that baseline is returned (with a
    CalibrationWarning). Their scores are kept under ``"baselines"`` and
    what was written under ``"guard"``.

    ``powers``: exponents p for the extra knapsack starts on KL**p (empty:
    start from the plain optimum only). ``method``: "swaps" (greedy
    swaps ranked by predicted summed-KL change) or "evolve" (the
    evolutionary search of :mod:`mixbits.measure.evolve`, scored on
    growing prefixes of the calibration chunks; ``max_evals`` counts
    full-set-equivalent evaluations).

    ``embed_bits``: embeddings and head out of the table and the budget,
    at that width (16: left float) in every joint evaluation, as
    ``quantize`` stores them; the layers the model pins (MoE gates...) are
    in every evaluation too (the evaluator's ``pinned``)."""
    if method not in ("swaps", "evolve"):
        raise ValueError(f"method must be 'swaps' or 'evolve', got {method!r}")
    from tqdm import tqdm

    if embed_bits is not None:
        table = without_outside(table)
        evaluator.pin_outside(embed_bits)
    alloc, sol, prob = allocate_table(table, high_avg, low_avg, count)
    names = prob.names
    cand_names = [[c["kind"] for c in e["candidates"]] for e in table["entries"]]
    choice = [int(j) for j in sol.choice]

    def assignment(ch):
        return {names[i]: cand_names[i][j] for i, j in enumerate(ch)}

    def sum_kl(ch):
        return math.fsum(prob.costs[i][j] for i, j in enumerate(ch))

    bar = tqdm(total=max_evals, desc="joint refine", unit="eval", disable=not progress)
    before, _ = evaluator.joint_kl(assignment(choice))
    evals = 1
    bar.update(1)
    current, bits = before, sol.bits
    starts = [{"power": 1.0, "sum_kl": sol.cost, "bits": int(sol.bits), "joint_kl": before,
               "choice": choice}]
    for p in powers:
        if evals >= max_evals:
            break
        sp = solve(_powered(prob, float(p)), sol.budget, sol.lower)
        ch = [int(j) for j in sp.choice]
        seen = next((s for s in starts if s["choice"] == ch), None)
        if seen is not None:
            kl = seen["joint_kl"]
        else:
            kl, _ = evaluator.joint_kl(assignment(ch))
            evals += 1
            bar.update(1)
        starts.append({"power": float(p), "sum_kl": sum_kl(ch), "bits": int(sp.bits),
                       "joint_kl": kl, "choice": ch})
        if kl < current:
            choice, current, bits = ch, kl, int(sp.bits)
    for s in starts:
        del s["choice"]
    tried, log = set(), []
    search = {}
    if method == "evolve":
        from .evolve import evolve

        def score(ch, chunks):
            return evaluator.joint_kl(assignment(ch), chunks)[0]

        def tick(gen, best, cost):
            bar.update(max(0, min(max_evals, evals + round(cost)) - bar.n))

        choice, current, cost, gens, wins = evolve(
            score, prob.weights, choice, current, sol.budget, sol.lower,
            n_chunks=evaluator.n_chunks, eval_budget=max_evals - evals, seed=seed, on_generation=tick)
        bits = int(sum(prob.weights[i][j] for i, j in enumerate(choice)))
        evals += cost
        search = {"method": "evolve", "generations": gens, "improvements": wins, "seed": seed}
    while method == "swaps" and evals < max_evals:
        moves = [m for m in _moves(prob, choice, bits, sol.budget, sol.lower)
                 if (m[1], m[2], m[3], m[4], tuple(choice)) not in tried]
        if not moves:
            break
        pred, a, ka, b, kb, nb = moves[0]
        tried.add((a, ka, b, kb, tuple(choice)))
        trial = list(choice)
        trial[a], trial[b] = ka, kb
        kl, _ = evaluator.joint_kl(assignment(trial))
        evals += 1
        bar.update(1)
        kept = kl < current
        log.append({"up": names[a], "up_to": cand_names[a][ka], "down": names[b],
                    "down_to": cand_names[b][kb], "predicted_delta_sum_kl": pred,
                    "joint_kl": kl, "kept": kept})
        if kept:
            choice, current, bits = trial, kl, nb
    bar.close()
    guarded = {}
    if check_baselines:
        from .baselines import guard

        checked = guard(table, evaluator, assignment(choice), current, high_avg, low_avg, count)
        win = checked["winner"]
        guarded = {"baselines": checked["baselines"],
                   "guard": {"written": win["name"] if win else "mixed allocation",
                             "joint_kl": win["joint_kl"] if win else current,
                             "mixed_joint_kl": current}}
        if win:
            choice = [cand_names[i].index(win["assignment"][n]) for i, n in enumerate(names)]
    out = allocation_from_choice(table, choice, low_avg, high_avg, count, embed_bits)
    out["dp_sum_kl"] = sol.cost
    ids = list(calibration_ids) if calibration_ids is not None else list(range(len(evaluator.tokens)))
    out["joint_refine"] = {
        "calibration_n": len(ids),
        "calibration_ids": ids,
        "joint_kl_before": before,
        "joint_kl_after": current,
        "starts": starts,
        "swaps": sum(1 for s in log if s["kept"]),
        "evaluations": round(evals, 3),
        "log": log,
        **search,
    }
    out["lagrangian_lower_bound"] = sol.lower_bound
    out.update(guarded)
    keys = ["average_bits", "embed_bits", "budget", "sum_kl", "dp_sum_kl", "joint_refine",
            "assignment"]
    return {k: out[k] for k in keys} | {k: v for k, v in out.items() if k not in keys}
