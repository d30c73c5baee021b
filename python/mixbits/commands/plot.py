"""``mixbits plot TABLE.json --out FIG.png``: sensitivity heatmaps."""

from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("table", help="sensitivity table written by `mixbits measure`")
    p.add_argument("--out", required=True, help="output image (PNG, SVG or PDF)")
    p.add_argument("--allocation", help="allocation.json whose chosen bits to show beside")
    p.add_argument("--title", default="")


def run(args) -> int:
    from ..measure.checkpoint import read_json
    from ..measure.plot import plot_table

    table = read_json(args.table, "sensitivity table")
    if not isinstance(table, dict) or not isinstance(table.get("entries"), list):
        raise SystemExit(f"{args.table}: not a sensitivity table (no 'entries' list)")
    alloc = read_json(args.allocation, "allocation") if args.allocation else None
    plot_table(table, args.out, alloc, args.title)
    print(f"wrote {args.out}")
    return 0
