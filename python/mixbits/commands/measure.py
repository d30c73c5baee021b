"""``mixbits measure``: per-tensor sensitivity sweep -> sensitivity table."""

from __future__ import annotations

import time
from pathlib import Path


def add_arguments(p) -> None:
    from ..measure.calib import add_calibration_arguments
    from ..measure.candidates import AWQ_HELP, DEFAULT_CANDIDATES, EXTENDED_CANDIDATES

    p.add_argument("--model", required=True,
                   help="'smollm2', 'gemma3', a .gguf file, or an mlx-lm model folder (any architecture "
                        "mlx-lm runs: the sweep calls the model's own forward)")
    add_calibration_arguments(p)
    p.add_argument("--out", required=True, help="sensitivity table (JSON), checkpointed per tensor")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted measurement in --out (with the same settings: the "
                        "exact sweep per tensor; grad and two-stage per rated tensor, the Fisher "
                        "pass from the last finished block)")
    p.add_argument("--candidates", nargs="+", default=list(DEFAULT_CANDIDATES),
                   help="names such as 2b_g64 3b_g64 4b_g32 8b_g128 ternary_g64 4b10_3b_g64, or a "
                        f"preset: 'default' ({' '.join(DEFAULT_CANDIDATES)}), 'extended' (default + "
                        f"{' '.join(EXTENDED_CANDIDATES[len(DEFAULT_CANDIDATES):])}), 'wide' (2/3/4/5/6/8 "
                        "bits at g64 and g128, ternary, three mixed kinds), 'fp' (MLX's modes mxfp4, "
                        "nvfp4, mxfp8: 4.25, 4.5, 8.25 bits per weight as stored, saved as MLX's own "
                        "layers) or 'all' (wide and fp); a tensor gets those whose "
                        "group size divides its K (multi-head stacks such as MLA's: single-segment only). "
                        "A suffix picks a calibrated quantizer, for linears inside decoder blocks: "
                        "+search (per-group clip search on the input-weighted error), +gptq (GPTQ "
                        "error feedback on the input's X^T X; mixed kinds in act-order), +act (mixed "
                        "kinds only: round-to-nearest, wide segment on the columns with the largest "
                        "E[x^2]*|W col|^2), e.g. 3b_g64+gptq 4b10_3b_g64+act")
    p.add_argument("--max-batch", type=int, default=8,
                   help="sequences per suffix forward (candidates are batched up to this)")
    p.add_argument("--tensors", nargs="+",
                   help="only these tensor paths (real module paths, e.g. "
                        "language_model.model.layers.0.mlp.down_proj); default: every quantizable "
                        "tensor the model's quant_predicate leaves to us, embeddings and heads included")
    p.add_argument("--exl2-out", metavar="MEASUREMENT.json",
                   help="also write an ExLlamaV2-style measurement.json (module output "
                        "relative error per option; uniform and mixed candidates only)")
    p.add_argument("--method", choices=("exact", "grad", "two-stage"), default="exact",
                   help="exact: quantize each tensor at each candidate and run the model (default); "
                        "grad: estimate every KL from diagonal-Fisher backward passes (one backward "
                        "per sequence and sample for all tensors; ignores interactions; 0.034x the "
                        "exact sweep's CPU time on SmolLM2-135M, 4 candidates; it is the KL's "
                        "second-order term, so it runs low where the KL grows faster than "
                        "quadratic at a candidate's error: soft-capped logits saturated far past "
                        "the cap, up to 2-3x at 2 bits on a tiny gemma2, 1.0-1.1x unsaturated; "
                        "two-stage rescales it per kind from its exact pairs); two-stage: "
                        "grad for all, "
                        "then exact for the (tensor, candidate) pairs nearest the allocator's "
                        "decision boundary at --targets, in rounds that recalibrate the proxy per "
                        "candidate kind, until --exact-budget is spent")
    p.add_argument("--targets", type=float, nargs="+", default=[3.0, 3.5, 4.0, 4.5], metavar="BPW",
                   help="two-stage: storage bpw budgets whose decisions must be exact")
    p.add_argument("--exact-budget", type=float, default=0.15, metavar="SHARE",
                   help="two-stage: cost of the exact stage as a share of a full exact sweep's "
                        "(counted in block forwards; default 0.15), in (0, 1]")
    p.add_argument("--fisher-samples", type=int, default=2,
                   help="grad/two-stage: sampled targets per sequence for the Fisher estimate")
    p.add_argument("--no-patch", action="store_true",
                   help="keep the model's own quantized layers instead of mixbits kernels")
    p.add_argument("--awq", metavar="KIND", help=AWQ_HELP)


def check_arguments(args) -> None:
    """Everything checkable before the model loads (which can take minutes)."""
    from ..measure.calib import check_calibration_arguments
    from ..measure.candidates import expand_candidates

    args.candidates = expand_candidates(args.candidates)
    if args.awq:
        from ..measure.candidates import awq_kind

        awq_kind(args.awq)
    if not 0 < args.exact_budget <= 1:
        raise ValueError(f"--exact-budget must be in (0, 1], got {args.exact_budget}")
    if args.method == "two-stage":
        from ..measure.candidates import parse_candidate

        least = min(parse_candidate(c).nominal_bits for c in args.candidates)
        low = [t for t in args.targets if t < least]
        if low:
            raise ValueError(f"--targets {low}: below the smallest candidate's {least} bits per "
                             "weight, no allocation fits")
    if args.fisher_samples < 1:
        raise ValueError(f"--fisher-samples must be >= 1, got {args.fisher_samples}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    for flag, path in (("--out", args.out), ("--exl2-out", args.exl2_out)):
        if path and Path(path).is_dir():
            raise ValueError(f"{flag} {path} is a directory; give a file name")
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{flag} {path}: folder {Path(path).resolve().parent} does not exist")
    if Path(args.out).exists() and not args.resume:
        raise ValueError(f"{args.out} exists; pass --resume to continue it or choose another --out")
    if args.exl2_out and Path(args.exl2_out).exists() and not args.resume:
        raise ValueError(f"{args.exl2_out} exists; pass --resume to continue it or choose another "
                         "--exl2-out")
    side = Path(args.out + ".exact.json")
    if args.method == "two-stage" and side.exists() and not args.resume:
        raise ValueError(f"{side} (an interrupted two-stage run's exact measurements) exists; pass "
                         "--resume to continue it or choose another --out")
    toks = check_calibration_arguments(args)
    if args.resume and Path(args.out).is_file():
        check_resume(args, toks)
    if args.resume and args.exl2_out and Path(args.exl2_out).is_file():
        check_exl2_resume(args, toks)


def check_exl2_resume(args, toks) -> None:
    """--exl2-out's candidates and tokens against this run's, before the
    model loads (measure_modules then checks the model's fingerprint too)."""
    from ..formats.errors import load_json
    from ..measure.candidates import parse_candidate
    from ..measure.sweep import settings_mismatch, token_settings

    prev = load_json(args.exl2_out, "measurement")
    meta = prev.get("mixbits_meta") if isinstance(prev, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    now = {"candidates": [parse_candidate(c).name for c in args.candidates
                          if not c.startswith("ternary")]}
    now.update(token_settings(toks, args.n_seq, args.seq_len))
    settings_mismatch(args.exl2_out, {k: meta.get(k) for k in now}, now)


def check_resume(args, toks) -> None:
    """The resume settings knowable without the model (method and its
    parameters, candidates, tokens, tensors), against --out's table, so a
    mismatch costs a second, not a model load. The sweep itself then
    checks everything (the model's fingerprint included)."""
    from ..errors import FormatError
    from ..formats.errors import load_json
    from ..measure.sweep import settings_mismatch, token_settings

    prev = load_json(args.out, "sensitivity table")
    meta = prev.get("meta") if isinstance(prev, dict) else None
    if not isinstance(meta, dict):
        raise FormatError(f"{args.out}: no 'meta' object, not a table `mixbits measure` wrote; "
                          "choose another --out")
    now = {"method": args.method, "model": str(args.model), "candidates": list(args.candidates)}
    if args.method != "exact":
        now["fisher_samples"] = args.fisher_samples
    if args.method == "two-stage":
        now.update(targets_bpw=list(args.targets), exact_budget=args.exact_budget)
    now.update(token_settings(toks, args.n_seq, args.seq_len))
    was = {k: meta.get(k) for k in now}
    sites = meta.get("sites")
    have = set(sites) if isinstance(sites, list) and all(isinstance(s, str) for s in sites) else set()
    # The table lists the tensors that had a fitting candidate, in the
    # model's order: tensors it has beyond --tensors mean another run.
    if args.tensors and not have <= set(args.tensors):
        now["sites"], was["sites"] = sorted(set(args.tensors)), sorted(have)
    settings_mismatch(args.out, was, now)


def outputs(args, g) -> list[str]:
    """The files this process writes, each locked for the whole run (one
    writer per output): with ranks, each rank's part file, and rank 0 also
    the merged table and --exl2-out."""
    from ..measure.distributed import part_path

    if g is None:
        return [p for p in (args.out, args.exl2_out) if p]
    mine = [str(part_path(args.out, g.rank(), g.size()))]
    return mine + ([p for p in (args.out, args.exl2_out) if p] if g.rank() == 0 else [])


def run(args) -> int:
    from contextlib import ExitStack

    from ..lock import output_lock
    from ..measure.distributed import group

    check_arguments(args)
    g = group()
    with ExitStack() as stack:
        # Before the model load: a second run on the same --out is refused
        # at once, not after minutes (or after overwriting this one's work).
        for path in outputs(args, g):
            stack.enter_context(output_lock(path))
        return _run(args, g)


def _run(args, g) -> int:
    from ..measure.calib import load_model_and_tokens
    from ..measure.distributed import sharded_sweep

    model, tokens = load_model_and_tokens(args, patch=not args.no_patch)
    if args.awq:
        from ..measure.awq_scale import apply_awq

        apply_awq(model, tokens, args.awq, progress=g is None or g.rank() == 0)
    t0 = time.perf_counter()
    if args.method != "exact":
        from ..measure.two_stage import proxy_sweep

        if g is not None and g.size() > 1:
            raise ValueError(f"--method {args.method} runs in one process (its exact stage is small)")
        table = proxy_sweep(model, tokens, args.out, args.candidates, method=args.method,
                            sites=args.tensors, targets=args.targets, budget=args.exact_budget,
                            samples=args.fisher_samples, max_batch=args.max_batch,
                            model_id=str(args.model), resume=args.resume)
    else:
        table = sharded_sweep(model, tokens, args.out, args.candidates, resume=args.resume,
                              model_id=str(args.model), max_batch=args.max_batch,
                              sites=args.tensors, progress=g is None or g.rank() == 0)
    dt = time.perf_counter() - t0
    if args.exl2_out and (g is None or g.rank() == 0):
        from ..measure.exl2_measure import measure_modules

        exl2_cands = [c for c in args.candidates if not c.startswith("ternary")]
        measure_modules(model, tokens, exl2_cands, args.exl2_out, resume=args.resume)
        print(f"wrote {args.exl2_out}")
    if table is not None:
        n = sum(len(e["candidates"]) for e in table["entries"])
        ntok = tokens.size
        print(f"{len(table['entries'])} tensors, {n} (tensor, candidate) pairs on "
              f"{ntok} tokens in {dt:.1f} s ({n / dt:.2f} candidate evals/s, "
              f"{n * ntok / dt:.0f} candidate-tokens/s); wrote {args.out}")
    return 0
