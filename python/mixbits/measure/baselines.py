"""The obvious allocations a mixed one must beat: uniform quantization and
mlx-lm's mixed recipe, built over a sensitivity table's tensors.

:func:`guard` scores them next to an allocation on the calibration
evaluation the allocator already ran. A per-tensor table measured on too
few tokens can rank tensors wrongly enough that the "optimal" allocation
is worse than one width everywhere (SmolLM2-135M, 2 x 64 calibration
tokens, gradient proxy: joint KL 2.58 at 3.5 bpw against uniform 3-bit's
2.47). That must never reach the user silently: the guard writes the
winning baseline instead and says what to raise.
"""

from __future__ import annotations

import warnings

import numpy as np

from ..errors import CalibrationWarning
from .candidates import parse_candidate
from .refine import option_bits


# mlx-lm's mixed recipes (mlx_lm.convert's QUANT_RECIPES: mixed_2_6, mixed_3_4,
# mixed_3_6, mixed_4_6) as (low, high) bits.
MLX_LM_RECIPES = ((2, 6), (3, 4), (3, 6), (4, 6))


def entry_bits(table: dict, assignment: dict[str, str], count: str = "storage") -> tuple[int, int]:
    """(total bits, total weights) of an assignment over the table's
    tensors; ``count`` "storage" (codes + scales + biases as stored) or
    "nominal" (bits x weights)."""
    bits = total = 0
    for e in table["entries"]:
        cands = {c["kind"]: c for c in e["candidates"]}
        name = assignment[e["path"]]
        if name not in cands:
            raise ValueError(f"{e['path']}: candidate {name!r} was not measured")
        bits += option_bits(cands[name], e["nparams"], count)
        total += e["nparams"]
    return bits, total


def entry_bpw(table: dict, assignment: dict[str, str], count: str = "storage") -> float:
    """Bits per weight of an assignment over the table's tensors (storage bits by default)."""
    bits, total = entry_bits(table, assignment, count)
    return bits / total


def uniform(table: dict, cand: str) -> dict[str, str]:
    return {e["path"]: cand for e in table["entries"]}


def common_kinds(table: dict) -> list[str]:
    """Candidates measured for every tensor, in the table's order."""
    kinds = [c["kind"] for c in table["entries"][0]["candidates"]]
    return [k for k in kinds if all(k in {c["kind"] for c in e["candidates"]} for e in table["entries"])]


def nearest_uniform(table: dict, bpw: float) -> tuple[str, float]:
    """The uniform candidate whose storage bpw is closest to ``bpw``."""
    scored = [(abs(entry_bpw(table, uniform(table, n)) - bpw), n) for n in common_kinds(table)]
    _, best = min(scored)
    return best, entry_bpw(table, uniform(table, best))


def mixed_rule(table: dict, low: str, high: str, adapter) -> dict[str, str]:
    """mlx-lm's mixed recipe, asked of the model's adapter: the attention
    value and MLP output projections of the first and last eighth of the
    blocks and of every third block between, and the output head, at
    ``high``; everything else at ``low``."""
    n_layers = len(adapter.blocks)
    eighth = n_layers // 8

    def more_bits(layer: int) -> bool:
        return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2

    out = {}
    for e in table["entries"]:
        site = adapter.site(e["path"])
        role = adapter.role(site)
        pick = role == "head" or (role in ("values", "down") and more_bits(site.block))
        out[e["path"]] = high if pick else low
    return out


def baselines(table: dict, adapter, high_avg: float, low_avg: float | None = None,
              count: str = "storage") -> list[tuple[str, dict[str, str], float]]:
    """[(name, assignment, bpw)]: the widest uniform candidate(s) and the
    widest of mlx-lm's mixed recipes (:data:`MLX_LM_RECIPES`, at a group
    size the table measured both widths at) within the budget; the recipe
    needs the model's ``adapter`` (its blocks and tensor roles) and is
    left out without one. Empty when nothing fits."""
    kinds = common_kinds(table)

    def fits(bpw: float) -> bool:
        return bpw <= high_avg + 1e-12 and (low_avg is None or bpw >= low_avg - 1e-12)

    out = []
    uni = [(entry_bpw(table, uniform(table, k), count), k) for k in kinds]
    uni = [(b, k) for b, k in uni if fits(b)]
    if uni:
        top = max(b for b, _ in uni)
        out += [(f"uniform {k}", uniform(table, k), b) for b, k in uni if b == top]
    affine = [parse_candidate(k) for k in kinds] if adapter is not None else []
    affine = [c for c in affine if c.kind == "uniform" and not c.calibrated]
    rules = []
    for lo in affine:
        for hi in affine:
            if lo.group_size == hi.group_size and (lo.bits, hi.bits) in MLX_LM_RECIPES:
                plan = mixed_rule(table, lo.name, hi.name, adapter)
                b = entry_bpw(table, plan, count)
                if fits(b):
                    rules.append((b, lo.name, hi.name, plan))
    if rules:
        b, lo, hi, plan = max(rules, key=lambda r: (r[0], r[1], r[2]))
        out.append((f"mlx-lm mixed recipe {lo}/{hi}", plan, b))
    return out


def guard(table: dict, evaluator, assignment: dict[str, str], joint_kl: float, high_avg: float,
          low_avg: float | None = None, count: str = "storage") -> dict:
    """Score the baselines within the budget on ``evaluator`` (the
    calibration evaluation the allocation was chosen on) and compare with
    the allocation's ``joint_kl``. Returns {"baselines": [{name, bpw,
    joint_kl}], "winner": None or the winning baseline's record with its
    "assignment"}; warns (:class:`CalibrationWarning`) when a baseline wins."""
    rows, best = [], None
    adapter = getattr(evaluator, "adapter", None)
    for name, plan, bpw in baselines(table, adapter, high_avg, low_avg, count):
        kl = evaluator.joint_kl(plan)[0]
        rows.append({"name": name, "bpw": bpw, "joint_kl": kl})
        if kl < joint_kl and (best is None or kl < best["joint_kl"]):
            best = {"name": name, "bpw": bpw, "joint_kl": kl, "assignment": plan}
    if best is not None:
        n, t = np.shape(evaluator.tokens)[:2]
        warnings.warn(
            f"{best['name']} ({best['bpw']:.3f} bpw) scored joint KL {best['joint_kl']:.4f} on the "
            f"calibration tokens, below the mixed allocation's {joint_kl:.4f}: writing {best['name']} "
            f"instead. The calibration set ({n} x {t} tokens) is too small or noisy for the "
            "per-tensor estimates: raise --n-seq / --seq-len (e.g. 8 x 256 or more), or measure "
            "with --method exact", CalibrationWarning, stacklevel=2)
    return {"baselines": rows, "winner": best}
