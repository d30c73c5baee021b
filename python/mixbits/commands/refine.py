"""``mixbits refine``: sensitivity table -> allocation.json (exact optimum
of summed KL under the budget, then joint-KL swaps on calibration data)."""

from __future__ import annotations


def add_embed_bits(p) -> None:
    """--embed-bits, as refine and allocate take it (quantize's own reads
    the allocation's by default)."""
    from ..formats.allocation import EMBED_BITS

    p.add_argument("--embed-bits", type=int, metavar="N", choices=EMBED_BITS,
                   help="embeddings and head at N bits outside the budget (16: left float), as "
                        "ExLlamaV2-derived allocations set them; default: allocated inside the "
                        "budget like every other tensor. allocation.json's embed_bits says which")


def add_arguments(p) -> None:
    from ..measure.calib import add_calibration_arguments

    p.add_argument("table", help="sensitivity table from `mixbits measure`")
    p.add_argument("--model", required=True, help="the model the table was measured on")
    add_calibration_arguments(p)
    p.add_argument("--bpw", type=float, required=True, help="upper bound on average bits per weight")
    p.add_argument("--low-bpw", type=float, help="lower bound on average bits per weight")
    p.add_argument("--count", choices=["storage", "nominal"], default="storage",
                   help="storage: codes + fp16 scales/biases (4-bit g64 = 4.5); nominal: bits only")
    p.add_argument("--max-evals", type=int, default=30,
                   help="joint-KL evaluations for the search (>= 1; with --method evolve, counted in "
                        "full-calibration-set equivalents)")
    p.add_argument("--method", choices=("swaps", "evolve"), default="swaps",
                   help="swaps: greedy one-up/one-down swaps ranked by predicted summed KL; evolve: "
                        "evolutionary search (random level switches, children scored on growing "
                        "prefixes of the calibration set)")
    p.add_argument("--seed", type=int, default=0, help="random seed of --method evolve")
    add_embed_bits(p)
    p.add_argument("--out", required=True, help="allocation.json to write")


def check(args) -> dict:
    """Every argument and the table, before the model loads."""
    from ..atomic import output_target
    from . import _checks

    _checks.positive_bpw("--bpw", args.bpw)
    _checks.positive_bpw("--low-bpw", args.low_bpw)
    if args.low_bpw is not None and args.low_bpw > args.bpw:
        raise _checks.UsageError(f"--low-bpw {args.low_bpw} is above --bpw {args.bpw}")
    _checks.at_least("--max-evals", args.max_evals, 1)
    _checks.calibration(args)
    output_target(args.out)
    return _checks.read_table(args.table)


def run(args) -> int:
    table = check(args)
    from ..atomic import write_json_atomic
    from ..measure.calib import load_model_and_tokens
    from ..measure.joint import JointEvaluator
    from ..measure.refine import refine

    model, tokens = load_model_and_tokens(args)
    from ..measure.identity import check_made_for

    check_made_for(model, table["entries"], args.table)  # a table of another model: before any work
    ev = JointEvaluator(model, tokens, chunk=4)
    out = refine(table, ev, args.bpw, args.low_bpw, args.count, args.max_evals,
                 method=args.method, seed=args.seed, embed_bits=args.embed_bits)
    write_json_atomic(out, args.out)
    jr = out["joint_refine"]
    how = (f"{jr['generations']} generations, {jr['improvements']} improvements"
           if jr.get("method") == "evolve" else f"{jr['swaps']} swaps kept")
    print(f"DP sum KL {out['dp_sum_kl']:.4f}; joint KL {jr['joint_kl_before']:.4f} -> "
          f"{jr['joint_kl_after']:.4f} ({how}; {jr['evaluations']} evaluations)")
    for b in out["baselines"]:
        print(f"  baseline {b['name']}: {b['bpw']:.3f} bpw, joint KL {b['joint_kl']:.4f}")
    bpw = out.get("average_bpw_storage", out["average_bits"])
    print(f"wrote {out['guard']['written']} ({bpw:.3f} {args.count} bpw, joint KL "
          f"{out['guard']['joint_kl']:.4f}) to {args.out}")
    return 0
