"""``mixbits plot TABLE.json --out FIG.png``: sensitivity heatmaps."""

from __future__ import annotations

from pathlib import Path

FORMATS = (".png", ".svg", ".pdf")


def add_arguments(p) -> None:
    p.add_argument("table", help="sensitivity table written by `mixbits measure`")
    p.add_argument("--out", required=True,
                   help="output image: .png, .svg or .pdf (no suffix: PNG, written to exactly this name)")
    p.add_argument("--allocation", help="allocation.json whose chosen bits to show beside")
    p.add_argument("--title", default="")


def _allocation(path, table: dict) -> dict:
    """The allocation's {path, bits} entries, which must all name tensors of
    the table (an allocation of another model is refused)."""
    from ..formats.errors import FormatError, at, expect_dict, expect_list, expect_number, expect_str, load_json, require

    raw = expect_dict(load_json(path, str(path)), str(path))
    entries = expect_list(require(raw, "assignment", str(path)), at(str(path), "assignment"))
    for i, e in enumerate(entries):
        where = at(at(str(path), "assignment"), i)
        expect_dict(e, where)
        expect_str(require(e, "path", where), at(where, "path"))
        expect_number(require(e, "bits", where), at(where, "bits"))
    known = {e["path"]: e for e in table["entries"]}
    foreign = [e["path"] for e in entries if e["path"] not in known]
    if foreign:
        raise FormatError(f"{path}: {len(foreign)} of its tensors are not in the table, e.g. {foreign[:3]}; "
                          "was the allocation made for another model?")
    for e in entries:  # same paths, other sizes: another model of the same family
        mine, theirs = e.get("nparams"), known[e["path"]].get("nparams")
        if mine is not None and mine != theirs:
            raise FormatError(f"{path} was made for another model than the table: tensor {e['path']} "
                              f"has {mine} parameters there and {theirs} in the table")
    return raw


def run(args) -> int:
    from ..atomic import output_target, replace_atomic
    from ..errors import UsageError
    from ..measure.plot import plot_table
    from . import _checks

    out = Path(args.out)
    suffix = out.suffix.lower()
    if suffix and suffix not in FORMATS:
        raise UsageError(f"--out {out}: unsupported image format {suffix!r} (use {', '.join(FORMATS)})")
    output_target(out)
    table = _checks.read_table(args.table, require_complete=False, known_kinds=False)  # only drawn
    alloc = _allocation(args.allocation, table) if args.allocation else None
    fmt = (suffix or ".png")[1:]

    def write(tmp):
        import matplotlib

        # A file object and an explicit format: given a name, matplotlib
        # infers the format from it and appends ".png" to a name without a
        # suffix, writing a file the user did not name.
        with open(tmp, "wb") as f, matplotlib.rc_context({"savefig.format": fmt}):
            plot_table(table, f, alloc, args.title)

    replace_atomic(out, write)
    print(f"wrote {out}")
    return 0
