"""``mixbits measure``: per-tensor sensitivity sweep -> sensitivity table."""

from __future__ import annotations

import time


def add_arguments(p) -> None:
    from ..measure.calib import add_calibration_arguments
    from ..measure.candidates import DEFAULT_CANDIDATES

    p.add_argument("--model", required=True,
                   help="'smollm2', a .gguf file, or a saved model folder")
    add_calibration_arguments(p)
    p.add_argument("--out", required=True, help="sensitivity table (JSON), checkpointed per tensor")
    p.add_argument("--resume", action="store_true", help="continue an interrupted sweep in --out")
    p.add_argument("--candidates", nargs="+", default=list(DEFAULT_CANDIDATES),
                   help="e.g. 2b_g64 3b_g64 4b_g32 8b_g128 ternary_g64 4b10_3b_g64")
    p.add_argument("--max-batch", type=int, default=8,
                   help="sequences per suffix forward (candidates are batched up to this)")
    p.add_argument("--tensors", nargs="+", help="only these tensor paths")
    p.add_argument("--exl2-out", metavar="MEASUREMENT.json",
                   help="also write an ExLlamaV2-style measurement.json (module output "
                        "relative error per option; uniform and mixed candidates only)")
    p.add_argument("--no-patch", action="store_true",
                   help="keep the model's own quantized layers instead of mixbits kernels")


def run(args) -> int:
    from ..measure.calib import load_model_and_tokens
    from ..measure.distributed import group, sharded_sweep

    g = group()
    model, tokens = load_model_and_tokens(args, patch=not args.no_patch)
    t0 = time.perf_counter()
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
        n = len(table["entries"]) * len(args.candidates)
        ntok = tokens.size
        print(f"{len(table['entries'])} tensors x {len(args.candidates)} candidates on "
              f"{ntok} tokens in {dt:.1f} s ({n / dt:.2f} candidate evals/s, "
              f"{n * ntok / dt:.0f} candidate-tokens/s); wrote {args.out}")
    return 0
