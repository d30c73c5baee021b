"""``mixbits quantize``: apply an allocation.json (one candidate per tensor)
to a model and save the result as a folder.

Tensors whose choice is a single MLX affine segment (every numeric kind,
and ternary, stored as 2-bit affine) load with ``mlx_lm.load``; the folder
always loads with ``mixbits.load``.
"""

from __future__ import annotations

import sys

DEFAULT_GROUP_SIZE = 64


def apply_allocation(alloc, model=None, *, group_size: int = DEFAULT_GROUP_SIZE, strip_prefix: str = "",
                     embed_paths=None) -> dict:
    """allocation entries {path, bits, kind} -> ``quantize_model`` assignment.

    ``strip_prefix`` is removed from each path (an allocation made for a
    wrapper model, e.g. ``language_model.``). With ``model`` given, each
    entry's nparams must match the tensor it names. ``embed_paths``: module
    paths to quantize at the allocation's ``embed_bits`` (if it has one).
    """
    from mixbits.formats.allocation import Allocation

    if not isinstance(alloc, Allocation):
        alloc = Allocation.load(alloc)
    sizes = {}
    if model is not None:
        from mixbits.nn import _weight_shape, weight_layers

        sizes = {p: _weight_shape(m) for p, m in weight_layers(model).items()}
    out = {}
    for i, e in enumerate(alloc.assignment):
        path = e.path[len(strip_prefix):] if strip_prefix and e.path.startswith(strip_prefix) else e.path
        if model is not None:
            if path not in sizes:
                raise KeyError(f"assignment[{i}]: path {path!r} is not a weight of this model")
            n, k = sizes[path]
            if n * k != e.nparams:
                raise ValueError(
                    f"assignment[{i}] ({path}): nparams {e.nparams} but the model's tensor is {n}x{k} = {n * k}; "
                    "was the allocation made for another model?"
                )
        bits = "ternary" if e.kind == "ternary" else e.bits
        out[path] = {"bits": bits, "group_size": group_size}
    if embed_paths and alloc.embed_bits is not None:
        for p in embed_paths:
            out.setdefault(p, {"bits": alloc.embed_bits, "group_size": group_size})
    return out


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, metavar="PATH", help="'smollm2', a llama .gguf file, or a model folder")
    p.add_argument("--allocation", required=True, metavar="ALLOCATION.json", help="per-tensor choices (allocation.json)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write (safetensors + config.json + tokenizer)")
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE, choices=(32, 64, 128),
                   help=f"group size of every assigned tensor (default {DEFAULT_GROUP_SIZE})")
    p.add_argument("--strip-prefix", default="", help="remove this prefix from allocation paths first")
    p.add_argument("--embed", action="store_true",
                   help="also quantize the embedding (model.embed_tokens, lm_head) at the allocation's embed_bits")


def run(args) -> int:
    import mixbits
    from mixbits.formats.allocation import Allocation
    from mixbits.formats.errors import FormatError

    try:
        alloc = Allocation.load(args.allocation)
    except (OSError, FormatError) as e:
        print(f"--allocation: {e}", file=sys.stderr)
        return 2
    try:
        model, tokenizer, config = mixbits.load(args.model)
    except FileNotFoundError as e:
        print(f"--model: {e}", file=sys.stderr)
        return 2
    embed = [p for p in ("model.embed_tokens", "lm_head") if args.embed and p in dict(model.named_modules())]
    try:
        assignment = apply_allocation(alloc, model, group_size=args.group_size,
                                      strip_prefix=args.strip_prefix, embed_paths=embed)
        replaced = mixbits.quantize_model(model, assignment)
    except (KeyError, ValueError, TypeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"--allocation: {msg}", file=sys.stderr)
        return 2
    mixbits.save(model, args.out, config, tokenizer)
    print(f"quantized {len(replaced)} tensors (average {alloc.average_bits:.3f} bits) -> {args.out}")
    return 0
