"""``mixbits compare``: joint KL of allocation strategies at matched bpw."""

from __future__ import annotations


def add_arguments(p) -> None:
    from ..measure.calib import add_calibration_arguments

    p.add_argument("table", help="sensitivity table from `mixbits measure`")
    p.add_argument("--model", required=True, help="the model the table was measured on")
    add_calibration_arguments(p)
    p.add_argument("--bpw", type=float, nargs="+", default=[3.5, 4.5], help="targets (storage bpw)")
    p.add_argument("--low", default="3b_g64", help="low candidate of the mixed rule")
    p.add_argument("--high", default="4b_g64", help="high candidate of the mixed rule")
    p.add_argument("--max-evals", type=int, default=20, help="joint-KL swaps tried per target")
    p.add_argument("--holdout-seq", type=int, default=0,
                   help="also score every allocation on this many sequences that follow the "
                        "calibration ones in the text (never used for choosing)")
    p.add_argument("--dynamic-quant", nargs=2, metavar=("LOW", "HIGH"),
                   help="also score mlx-lm's dynamic_quant recipe (its gradient sensitivities on "
                        "these calibration tokens; LOW/HIGH are table candidates, e.g. 3b_g64 4b_g64)")
    p.add_argument("--json", help="also write the rows as JSON here")
    p.add_argument("--save-allocations", metavar="DIR",
                   help="write each refined allocation as DIR/allocation_<bpw>bpw.json")


def run(args) -> int:
    from ..measure.calib import load_model_and_tokens
    from ..atomic import output_target, write_json_atomic
    from ..measure.compare import compare, format_rows
    from ..measure.joint import JointEvaluator
    from . import _checks

    # Arguments, outputs and the table first: the model load takes 10-40 s.
    _checks.positive_bpw("--bpw", args.bpw)
    _checks.at_least("--max-evals", args.max_evals, 1)
    _checks.at_least("--holdout-seq", args.holdout_seq, 0)
    _checks.calibration(args)
    if args.json:
        output_target(args.json)
    if args.save_allocations:
        from pathlib import Path

        from ..errors import OutputPathError

        d = Path(args.save_allocations)  # made when the first allocation is written, after the work
        if d.exists() and not d.is_dir():
            raise OutputPathError(f"--save-allocations {d}: it exists and is not a folder")
        if not d.exists() and any(p.exists() and not p.is_dir() for p in d.parents):
            raise OutputPathError(f"--save-allocations {d}: a parent of it is not a folder")
    table = _checks.read_table(args.table)
    n_cal = args.n_seq
    args.n_seq = n_cal + args.holdout_seq
    model, tokens = load_model_and_tokens(args)
    from ..measure.identity import check_made_for

    check_made_for(model, table["entries"], args.table)  # a table of another model: before any work
    if args.tokens:  # the file's own rows: the last --holdout-seq are held out
        n_cal = len(tokens) - args.holdout_seq
        if n_cal < 1:
            raise ValueError(f"--tokens has {len(tokens)} sequences; --holdout-seq "
                             f"{args.holdout_seq} leaves none for calibration")
    tokens, held = tokens[:n_cal], tokens[n_cal:]
    ev = JointEvaluator(model, tokens, chunk=4)
    # Calibrated candidates on held-out tokens are fitted on the calibration
    # tokens (ev), never on the tokens that score them.
    hold = JointEvaluator(model, held, chunk=4, calibration=ev) if len(held) else None
    def save(bpw, alloc):
        if args.save_allocations:
            from pathlib import Path

            out = Path(args.save_allocations) / f"allocation_{bpw:.3f}bpw.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(alloc, out)

    dynamic = None
    if args.dynamic_quant:
        from ..measure.candidates import parse_candidate
        from ..measure.dynamic_quant import sensitivities

        lo, hi = (parse_candidate(c) for c in args.dynamic_quant)
        if lo.kind != "uniform" or hi.kind != "uniform":
            raise ValueError("--dynamic-quant takes two uniform candidates, e.g. 3b_g64 4b_g64")
        sens = sensitivities(model, tokens, (lo.bits, lo.group_size), (hi.bits, hi.group_size))
        dynamic = (sens, lo.name, hi.name)
    rows = compare(table, ev, args.bpw, args.low, args.high, args.max_evals, progress=True,
                   holdout=hold, on_refined=save, dynamic=dynamic)
    print(f"joint KL on {tokens.shape[0]} x {tokens.shape[1]} calibration tokens"
          + (f"; held out: {held.shape[0]} x {held.shape[1]}" if hold else ""))
    print(format_rows(rows))
    if args.json:
        write_json_atomic(rows, args.json)
    return 0
