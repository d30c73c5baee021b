"""``mixbits allocate``: choose one option per module (ExLlamaV2
measurement.json) or per tensor (mixbits sensitivity table) under a bit
budget, exactly, and write the result (an ExLlamaV2 strategy, or an
allocation.json)."""

from __future__ import annotations

import sys
from collections import Counter, defaultdict

from ..alloc import MCKProblem, solve
from ..atomic import output_target
from ..formats import FormatError, Measurement, SensitivityTable, is_sensitivity_table, projection_shapes
from ..formats.errors import load_json, write_json_atomic
from ..formats.exl2 import layer_of
from ..measure.refine import chosen_embed_bits, without_outside


def add_arguments(p) -> None:
    p.add_argument("input", metavar="MEASUREMENT.json",
                   help="ExLlamaV2 measurement.json, or a mixbits per-tensor sensitivity table")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--budget-bits", type=int, metavar="B", help="upper bound on the summed bits")
    g.add_argument("--bpw", type=float, metavar="X",
                   help="upper bound in bits per weight of the allocated tensors, i.e. floor(X * their "
                        "weights) bits (needs the shapes: --config for a measurement, counting the "
                        "projections' weights; a sensitivity table carries nparams)")
    lo = p.add_mutually_exclusive_group()
    lo.add_argument("--min-bits", type=int, metavar="B", help="optional lower bound on the summed bits")
    lo.add_argument("--min-bpw", type=float, metavar="X", help="optional lower bound in bits per weight")
    p.add_argument("--power", type=float, default=2.0, metavar="P",
                   help="measurement cost is sum of (1 - accuracy)^P (default 2; ExLlamaV2 tunes P in 1.5..3.5)")
    p.add_argument("--config", metavar="config.json",
                   help="Hugging Face config.json of the model: projection shapes, used for --bpw and to "
                        "check every option's total_bits")
    p.add_argument("--out", required=True, metavar="STRATEGY.json",
                   help="strategy (module -> chosen option) for a measurement; allocation.json for a table")
    p.add_argument("--count", choices=("nominal", "storage"), default="storage",
                   help="sensitivity tables: budget counts each candidate's storage bits (codes + "
                        "scales + biases + permutation: 4-bit g64 = 4.5 bpw; default, as refine and "
                        "compare) or nominal bits (nparams*bits, allocation.json's average_bits)")
    from .refine import add_embed_bits

    add_embed_bits(p)  # sensitivity tables only
    p.add_argument("--quiet", action="store_true", help="print only the totals, not the per-layer table")


def _budgets(args, problem: MCKProblem):
    if args.bpw is not None:
        budget = problem.budget_from_bpw(args.bpw)
    else:
        budget = args.budget_bits
        if budget < 0:
            raise ValueError(f"--budget-bits must be >= 0, got {budget}")
    lower = args.min_bits
    if args.min_bpw is not None:
        if problem.nparams is None:
            raise ValueError("--min-bpw needs the tensor shapes (--config)")
        lower = problem.budget_from_bpw(args.min_bpw, round_up=True)
    if lower is not None and lower < 0:
        raise ValueError(f"--min-bits must be >= 0, got {lower}")
    return budget, lower


def _print_totals(sol, out_path) -> None:
    out = sys.stdout
    bpw = f"  ({sol.bpw:.4f} bpw)" if sol.bpw is not None else ""
    print(f"cost {sol.cost:.8g}   bits {sol.bits} of budget {sol.budget}{bpw}", file=out)
    print(f"Lagrangian lower bound {sol.lower_bound:.8g}   gap {sol.gap:.3g}   "
          f"solved exactly in {sol.stats['seconds'] * 1e3:.1f} ms", file=out)
    print(f"wrote {out_path}", file=out)


def _run_measurement(args, raw) -> int:
    meas = Measurement.from_dict(raw)
    shapes = projection_shapes(args.config) if args.config else None
    if args.bpw is not None and shapes is None:
        raise ValueError("--bpw with a measurement needs the projection shapes: pass --config config.json")
    problem = MCKProblem.from_measurement(meas, args.power, shapes)
    budget, lower = _budgets(args, problem)
    sol = solve(problem, budget, lower)
    mods = meas.measured()
    chosen = {k: opts[j] for (k, opts), j in zip(mods.items(), sol.choice)}
    write_json_atomic({k: o.to_dict() for k, o in chosen.items()}, args.out)
    if not args.quiet:
        nparams = dict(zip(problem.names, problem.nparams)) if problem.nparams is not None else None
        print(f"{'layer':>5}  {'module':<28} {'option':>6} {'accuracy':>10} {'total_bits':>12} {'bpw':>7}")
        for (k, opts), j in zip(mods.items(), sol.choice):
            o = opts[j]
            layer = layer_of(k)
            bpw = f"{o.total_bits / nparams[k]:7.3f}" if nparams else f"{'-':>7}"
            short = k.split(f"layers.{layer}.", 1)[-1] if layer is not None else k
            print(f"{layer if layer is not None else '-':>5}  {short:<28} {j:>6} {o.accuracy:>10.6f} "
                  f"{o.total_bits:>12} {bpw}")
    _print_totals(sol, args.out)
    return 0


def _run_table(args, raw) -> int:
    table = SensitivityTable.from_dict(raw)
    if not table.complete:
        raise FormatError(f"{args.input}: the sweep that wrote this table has not finished ('complete': false)")
    if args.embed_bits is not None:  # embeddings and head out of the table and the budget
        try:
            table = SensitivityTable.from_dict(without_outside(raw))
        except ValueError as e:
            raise FormatError(f"{args.input}: {e}") from None
    problem = MCKProblem.from_table(table, args.count)
    budget, lower = _budgets(args, problem)
    sol = solve(problem, budget, lower)
    n = problem.total_params
    alloc = table.to_allocation(sol.choice, low_avg=(lower / n if lower is not None else None),
                                high_avg=budget / n, count=args.count)
    # embed_bits says what was chosen: --embed-bits, or the width the
    # allocation gave the embeddings and head, not the table's default.
    alloc.embed_bits = chosen_embed_bits(
        raw, [{"layer": e.layer, "bits": e.bits} for e in alloc.assignment], args.embed_bits)
    alloc.save(args.out)
    if not args.quiet:
        per_layer = defaultdict(list)
        for e in alloc.assignment:
            per_layer[e.layer].append(e)
        print(f"{'layer':>5} {'tensors':>7} {'avg bits':>8} {'sum kl':>12}  kinds")
        for layer in sorted(per_layer, key=lambda x: (x is None, x if x is not None else 0)):
            es = per_layer[layer]
            nl = sum(e.nparams for e in es)
            avg = sum(e.nparams * e.bits for e in es) / nl
            kinds = " ".join(f"{k}x{c}" for k, c in sorted(Counter(e.kind for e in es).items()))
            print(f"{layer if layer is not None else '-':>5} {len(es):>7} {avg:>8.3f} "
                  f"{sum(e.kl for e in es):>12.6g}  {kinds}")
    _print_totals(sol, args.out)
    return 0


def run(args) -> int:
    # Errors (FormatError, InfeasibleBudget, OutputPathError ...) are printed
    # as one line by mixbits.cli.
    output_target(args.out)  # a directory or device as --out fails before any work
    raw = load_json(args.input, args.input, unique_keys=True)
    if is_sensitivity_table(raw):
        return _run_table(args, raw)
    if isinstance(raw, dict) and "measurement" in raw:
        if args.embed_bits is not None:
            from ..errors import UsageError

            raise UsageError("--embed-bits is for sensitivity tables: an ExLlamaV2 measurement has no "
                             "embeddings or head to set apart")
        return _run_measurement(args, raw)
    raise FormatError(
        f"{args.input}: neither an ExLlamaV2 measurement (no 'measurement' key) nor a "
        "sensitivity table ('format': 'mixbits.sensitivity')"
    )
