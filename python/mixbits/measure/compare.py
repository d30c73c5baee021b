"""Joint KL of allocation strategies at matched bits per weight:
our refined allocation, the knapsack optimum before refinement, uniform
quantization at the nearest bpw, and mlx-lm's ``mixed_3_4``-style rule
(more bits for v_proj and down_proj in the first and last eighth of the
layers and in every third layer between)."""

from __future__ import annotations

from .baselines import entry_bpw, mixed_rule, nearest_uniform, uniform  # noqa: F401  (re-exported)
from .refine import allocate_table, refine


def compare(table: dict, evaluator, targets: list[float], low: str = "3b_g64",
            high: str = "4b_g64", max_evals: int = 20, progress: bool = False,
            holdout=None, on_refined=None, dynamic=None) -> list[dict]:
    """One row per target bpw (and one at the mixed rule's bpw): joint KL of
    the baseline, the knapsack optimum and the refined allocation on the
    calibration set of ``evaluator``; with a second evaluator ``holdout``
    (other tokens, never used for choosing), also each one's joint KL there
    (``holdout_joint_kl``), which shows whether refinement only fits the
    calibration set. ``on_refined(target_bpw, allocation)`` receives each
    refined allocation (allocation.json layout). ``dynamic``: (mlx-lm
    dynamic_quant sensitivities, low, high candidate names) adds that
    recipe at each target (``row["dynamic_quant"]``)."""
    from .dynamic_quant import assignment as dynamic_assignment

    rows = []
    rule = mixed_rule(table, low, high, evaluator.adapter)
    rule_bpw = entry_bpw(table, rule)
    for bpw in [*targets, rule_bpw]:
        alloc, sol, _ = allocate_table(table, bpw)
        dp_assign = {a["path"]: a["kind"] for a in alloc["assignment"]}
        ref = refine(table, evaluator, bpw, max_evals=max_evals, progress=progress,
                     check_baselines=False)
        if on_refined is not None:
            on_refined(bpw, ref)
        jr = ref["joint_refine"]
        row = {"target_bpw": bpw,
               "dp": {"bpw": entry_bpw(table, dp_assign), "sum_kl": sol.cost,
                      "joint_kl": jr["joint_kl_before"]},
               "refined": {"bpw": ref["average_bpw_storage"],
                           "joint_kl": jr["joint_kl_after"],
                           "swaps": jr["swaps"],
                           "evaluations": jr["evaluations"],
                           "starts": jr["starts"]}}
        if bpw is rule_bpw:
            base = rule
            row["baseline"] = {"name": f"mixed rule {low}/{high}", "bpw": rule_bpw}
        else:
            name, ubpw = nearest_uniform(table, bpw)
            base = uniform(table, name)
            row["baseline"] = {"name": f"uniform {name}", "bpw": ubpw}
        row["baseline"]["joint_kl"] = evaluator.joint_kl(base)[0]
        plans = [("baseline", base), ("dp", dp_assign),
                 ("refined", {a["path"]: a["kind"] for a in ref["assignment"]})]
        if dynamic is not None and bpw is not rule_bpw:
            sens, d_low, d_high = dynamic
            dq = dynamic_assignment(table, sens, bpw, d_low, d_high)
            row["dynamic_quant"] = {"name": f"mlx-lm dynamic_quant {d_low}/{d_high}",
                                    "bpw": entry_bpw(table, dq), "joint_kl": evaluator.joint_kl(dq)[0]}
            plans.append(("dynamic_quant", dq))
        if holdout is not None:
            for key, assign in plans:
                row[key]["holdout_joint_kl"] = holdout.joint_kl(assign)[0]
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = ["| target bpw | baseline | baseline bpw | baseline joint KL | DP bpw | DP joint KL "
             "| refined bpw | refined joint KL | swaps kept/tried |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, d, f = r["baseline"], r["dp"], r["refined"]
        lines.append(f"| {r['target_bpw']:.3f} | {b['name']} | {b['bpw']:.3f} | {b['joint_kl']:.4f} "
                     f"| {d['bpw']:.3f} | {d['joint_kl']:.4f} | {f['bpw']:.3f} | {f['joint_kl']:.4f} "
                     f"| {f['swaps']}/{f['evaluations']} |")
    dq = [r for r in rows if "dynamic_quant" in r]
    if dq:
        lines += ["", f"{dq[0]['dynamic_quant']['name']} (same storage-bpw targets):", "",
                  "| target bpw | bpw | joint KL | held-out joint KL |", "|---|---|---|---|"]
        for r in dq:
            d = r["dynamic_quant"]
            lines.append(f"| {r['target_bpw']:.3f} | {d['bpw']:.3f} | {d['joint_kl']:.4f} "
                         f"| {d.get('holdout_joint_kl', float('nan')):.4f} |")
    if rows and "holdout_joint_kl" in rows[0]["baseline"]:
        lines += ["", "held-out tokens (not used for any choice):", "",
                  "| target bpw | baseline | DP | refined |", "|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['target_bpw']:.3f} | {r['baseline']['holdout_joint_kl']:.4f} "
                         f"| {r['dp']['holdout_joint_kl']:.4f} | {r['refined']['holdout_joint_kl']:.4f} |")
    return "\n".join(lines)
