"""``mixbits quantize``: apply an allocation.json (one candidate per tensor)
to a model and save the result as a folder.

Tensors whose choice is a single MLX affine segment (every numeric kind,
and ternary, stored as 2-bit affine) load with ``mlx_lm.load``; the folder
always loads with ``mixbits.load``.
"""

from __future__ import annotations

from ..formats.allocation import EMBED_BITS as EMBED_CHOICES
from ..layout import DEFAULT_GROUP_SIZE


def allocation_candidates(alloc, model, *, group_size: int = DEFAULT_GROUP_SIZE,
                          strip_prefix: str = "") -> dict:
    """allocation entries -> {module path: Candidate}, each checked against
    the model's tensor (:func:`mixbits.measure.identity.check_made_for`:
    path exists, same size; then the candidate fits)."""
    from mixbits.formats.allocation import Allocation
    from mixbits.measure.candidates import candidate_for_entry, supports
    from mixbits.measure.identity import check_made_for

    if not isinstance(alloc, Allocation):
        alloc = Allocation.load(alloc)
    known = check_made_for(model, alloc.assignment, "the allocation", strip_prefix=strip_prefix)
    out = {}
    for i, e in enumerate(alloc.assignment):
        path = e.path[len(strip_prefix):] if strip_prefix and e.path.startswith(strip_prefix) else e.path
        site = known[path]
        cand = candidate_for_entry(e.kind, e.bits, group_size)
        if not supports(cand, site):
            raise ValueError(f"assignment[{i}] ({path}): candidate {cand.name!r} does not fit a "
                             f"{site.form} of shape {site.shape}")
        out[path] = cand
    return out


def quantize_candidates(model, chosen: dict, scale_dtype=None, *, fixed: bool = True,
                        tokens=None, embed_bits: int | None = None,
                        group_size: int = DEFAULT_GROUP_SIZE, progress: bool = False,
                        measured=None) -> list[str]:
    """Replace every tensor in ``chosen`` ({path: Candidate}) by its
    candidate module -- the same constructor the sweep measured -- and,
    with ``fixed``, the tensors the model's own quant_predicate pins (e.g.
    MoE router gates at 8 bits), as mlx-lm would. Calibrated candidates
    (``+gptq``, ``+search``) need the calibration ``tokens`` [n_seq, seq_len]
    their layer inputs come from (the sweep's). ``embed_bits``: embeddings
    and head not in ``chosen`` at that width (:func:`mixbits.measure.candidates.embed_candidates`).
    ``progress``: a bar of the tensors built (stderr). ``measured``: the same
    weights as the sweep ran them (:func:`mixbits.measure.calib.load_model`:
    quantized layers on mixbits' kernels, float weights at the calibration
    dtype), whose forward gives the calibrated layers' inputs; default
    ``model`` itself. Then each X^T X is the sweep's and the joint
    evaluator's bit for bit (so a calibrated layer is the one they
    measured), and the forward runs on mixbits' kernels, not MLX's CPU
    quantized matmul. Returns replaced paths."""
    import mlx.core as mx

    from mixbits.adapter import ModelAdapter
    from mixbits.measure.candidates import build_layer, embed_candidates, needs_inputs, parse_candidate

    adapter = ModelAdapter(model)
    plan = {**embed_candidates(model, chosen, embed_bits, group_size), **chosen}
    if fixed:
        for path, spec in adapter.fixed.items():
            plan.setdefault(path, parse_candidate(f"{spec['bits']}b_g{spec['group_size']}"))
    rp = None
    if any(c.calibrated for c in plan.values()):
        from mixbits.measure.replay import Replayer, token_chunks

        if tokens is None:
            raise ValueError("the allocation has calibrated candidates (+gptq/+search/+act): give the "
                             "calibration tokens they were measured with (--tokens or --text)")
        ref, ref_adapter = model, adapter
        if measured is not None:
            ref, ref_adapter = measured, ModelAdapter(measured)
            if [(s.path, s.shape) for s in ref_adapter.sites] != [(s.path, s.shape) for s in adapter.sites]:
                raise ValueError("measured must be the same model as model (the same quantizable tensors)")
        rp = Replayer(ref, token_chunks(tokens, 4), ref_adapter, logits=False)  # X^T X only
    from mixbits import streaming

    # Hessians come from the unquantized model: all layers are built before
    # any is swapped in. Tensor by tensor, block by block: each built and
    # evaluated, then its float weight let go (a model loaded lazily keeps
    # it on disk). The inputs of a block's calibrated linears are recorded
    # in one replay of the block (Replayer.input_hessian's ``along``).
    blocks = {s.path: s.block for s in adapter.sites}  # paths the model pins may not be sites
    plan = dict(sorted(plan.items(), key=lambda pc: -1 if blocks.get(pc[0]) is None else blocks[pc[0]]))
    calibrated = [adapter.site(p) for p, c in plan.items() if c.calibrated and needs_inputs(c, adapter.site(p))]
    from tqdm import tqdm

    built = {}
    for p, c in tqdm(plan.items(), total=len(plan), desc="quantize", unit="tensor", disable=not progress):
        original = adapter.get(p)
        inputs = None
        if c.calibrated and needs_inputs(c, adapter.site(p)):
            inputs = rp.input_hessian(adapter.site(p), along=calibrated)
        layer = build_layer(original, c, scale_dtype, inputs)
        del inputs
        mx.eval(layer.parameters())
        built[p] = layer
        streaming.release(original)
    if rp is not None:
        rp.forget_inputs()
    for p, layer in built.items():
        adapter.set(p, layer)
    return list(built)


def measured_twin(args, chosen: dict, model):
    """The model as the sweep runs it (:func:`mixbits.measure.calib.load_model`,
    weights on disk) when ``chosen`` has calibrated kinds, for their layer
    inputs; None otherwise, and with --awq (the scales are searched on
    ``model``, whose layer inputs they change)."""
    if getattr(args, "awq", None) or not any(c.calibrated for c in chosen.values()):
        return None
    from mixbits.measure.calib import load_model

    measured, _ = load_model(args)
    return measured


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, metavar="PATH", help="'smollm2', 'gemma3', a .gguf file (llama, qwen2/3, gemma3, phi3) or an mlx-lm model folder")
    p.add_argument("--allocation", required=True, metavar="ALLOCATION.json", help="per-tensor choices (allocation.json)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write (safetensors + config.json + tokenizer)")
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE, choices=(32, 64, 128),
                   help="group size for entries whose kind is a bare width ('4', 'ternary'); "
                        f"candidate names ('4b_g32') carry their own (default {DEFAULT_GROUP_SIZE})")
    p.add_argument("--strip-prefix", default="", help="remove this prefix from allocation paths first")
    p.add_argument("--embed-bits", type=int, metavar="N", choices=EMBED_CHOICES,
                   help="embeddings and head the allocation does not assign: N bits at --group-size "
                        "(16: left float); default: the allocation's embed_bits")
    p.add_argument("--tokens", metavar="FILE",
                   help="calibration token ids (.npy/.json [n_seq, seq_len]) for calibrated candidates "
                        "(+gptq, +search, +act): the layer inputs they quantize against; use the sweep's")
    from mixbits.measure.calib import add_dtype_argument
    from mixbits.measure.candidates import AWQ_HELP

    p.add_argument("--awq", metavar="KIND", help=AWQ_HELP + " (needs --tokens)")
    add_dtype_argument(p, "; for calibrated candidates give measure's, so their layer inputs are the "
                          "ones measure and refine saw")


def run(args) -> int:
    from mixbits.lock import output_lock

    # --out's lock for the whole run (the save takes it too): a second
    # quantize into the same folder is refused now, not after the model load.
    with output_lock(args.out):
        return _run(args)


def _run(args) -> int:
    import mixbits
    from mixbits.formats.allocation import Allocation
    from mixbits.formats.errors import FormatError

    from mixbits.folder import check_replaceable

    # Everything checkable is checked before the model load; errors are
    # printed as one line by mixbits.cli.
    if args.awq:
        from mixbits.errors import UsageError
        from mixbits.measure.candidates import awq_kind

        awq_kind(args.awq)
        if not args.tokens:
            raise UsageError("--awq needs the calibration tokens (--tokens) the scales are searched on")
    try:
        alloc = Allocation.load(args.allocation)
    except (OSError, FormatError) as e:
        raise FormatError(f"--allocation: {e}") from None
    from mixbits.measure.candidates import candidate_for_entry

    for i, e in enumerate(alloc.assignment):  # kind names ('5b_g48', '+magic'): now, not after the load
        try:
            candidate_for_entry(e.kind, e.bits, args.group_size)
        except ValueError as err:
            raise FormatError(f"--allocation {args.allocation}: assignment[{i}] ({e.path}): {err}") from None
    check_replaceable(args.out)  # a file, device or folder of other files as --out fails now
    tokens = None
    if args.tokens:
        from mixbits.measure.calib import load_tokens

        tokens = load_tokens(args.tokens)
    try:
        # Lazily: each tensor is read when it is quantized (mixbits.streaming).
        model, tokenizer, config = mixbits.load(args.model, lazy=True)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--model: {e}") from None
    from mixbits.measure.identity import check_made_for

    # An allocation of another model: refused before the AWQ search or any quantization.
    check_made_for(model, alloc.assignment, f"--allocation {args.allocation}",
                   strip_prefix=args.strip_prefix)
    if args.awq:
        from mixbits.measure.awq_scale import apply_awq

        apply_awq(model, tokens, args.awq)
    try:
        chosen = allocation_candidates(alloc, model, group_size=args.group_size,
                                       strip_prefix=args.strip_prefix)
        embed = args.embed_bits if args.embed_bits is not None else alloc.embed_bits
        replaced = quantize_candidates(model, chosen, tokens=tokens, embed_bits=embed,
                                       group_size=args.group_size, progress=True,
                                       measured=measured_twin(args, chosen, model))
    except (KeyError, ValueError, TypeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise FormatError(f"--allocation: {msg}") from None
    mixbits.save(model, args.out, config, tokenizer)
    from mixbits.formats.allocation import average_storage_bits

    storage = average_storage_bits(alloc.assignment)
    what = (f"{storage:.3f} bits per weight as stored" if storage is not None
            else f"{alloc.average_bits:.3f} nominal bits per weight")
    print(f"quantized {len(replaced)} tensors ({what}) -> {args.out}")
    return 0
