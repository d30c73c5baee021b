"""SmolLM2-135M Q4_1 end to end, one thread, CPU time: prefill (64 tokens)
and decode tokens/s, plain decode (``model(token, cache)``) next to the
compiled decode (``mixbits.decode.Decoder``), for stock MLX quantized
layers and for mixbits layers (``mixbits.patch``).

    OPENBLAS_NUM_THREADS=1 python bench/bench_decode.py [--steps 32] [--reps 4]

Decode: median per-token CPU time over ``--reps`` interleaved rounds, each
a fresh prefill of the 64-token prompt then 2 untimed + ``--steps`` timed
greedy steps (bench/decode_profile.py's rounds), and the fastest token
(``*_best``: noise only adds time). The compiled step's one-off trace and
check (its first step) are untimed there and reported as ``first_step_s``
(CPU seconds). Saves bench/results/decode.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from decode_profile import RESULTS, Compiled, Plain, load_smollm2, prompt_ids, rounds, setup_cpu_one_thread, warm


def prefill_tps(model, ids, reps: int) -> float:
    from mlx_lm.models.cache import make_prompt_cache

    ts = []
    for _ in range(reps + 1):
        cache = make_prompt_cache(model)
        t0 = time.process_time()
        mx.eval(model(mx.array([ids]), cache=cache))
        ts.append(time.process_time() - t0)
    return len(ids) / statistics.median(ts[1:])


def decode_tps(model, ids, steps: int, reps: int) -> dict:
    from mixbits.decode import Unsupported

    try:
        samples = rounds(model, ids, [Plain, Compiled], steps, reps)
    except Unsupported as e:
        # The compiled step checks its first logits against the plain step's;
        # under activations="int8" the fused elementwise chains round x
        # differently, int8 rounding amplifies that, and the check refuses:
        # reported, and the plain step timed alone.
        print(f"compiled decode refused: {e}", flush=True)
        samples = rounds(model, ids, [Plain], steps, reps)
    out = {"compiled": None, "compiled_best": None, "first_step_s": None}
    for name, (build, ev) in samples.items():
        per = [b + e for b, e in zip(build, ev)]
        out[name], out[f"{name}_best"] = 1 / statistics.median(per), 1 / min(per)
    if out["compiled"] is not None:
        # The one-off cost of a compiled generation's first step (trace + check).
        m = Compiled(model, ids, len(ids) + 8)
        t0 = time.process_time()
        warm(m, 1)
        out["first_step_s"] = time.process_time() - t0
    return out


def set_activations(model, act: str) -> None:
    """Every mixbits linear layer (and the tied head) on contract `act`."""
    import mixbits

    kinds = (mixbits.nn.MixedQuantizedLinear, mixbits.nn.MixedQuantizedEmbedding)
    layers = [m for _, m in model.named_modules() if isinstance(m, kinds)]
    if not layers:
        raise SystemExit("no mixbits layers to set activations on")
    for m in layers:
        m.activations = act


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--impl", nargs="+", default=["mlx", "mixbits"],
                    choices=["mlx", "mixbits", "mixbits-int8", "mixbits-int16", "mixbits-int8-repacked",
                             "mixbits-int16-repacked", "mixbits-int8-repacked-linears",
                             "mixbits-int16-repacked-linears"],
                    help="mixbits-int8/-int16: the patched model with that activations= contract; "
                         "-repacked: that contract with the linear layers and the tied head's table in the "
                         "row-interleaved layout (mixbits.nn.repack_layers); -repacked-linears: the same "
                         "with the tied head left in MLX's layout")
    ap.add_argument("--out", default=str(RESULTS / "decode.json"))
    a = ap.parse_args(argv)
    setup_cpu_one_thread()
    rows = []
    for impl in a.impl:
        model, tok = load_smollm2(patch=impl.startswith("mixbits"))
        if "-" in impl:
            set_activations(model, impl.split("-")[1])
        if "-repacked" in impl:
            import mixbits

            print(f"repacked {len(mixbits.nn.repack_layers(model))} layers", flush=True)
            if impl.endswith("-linears"):
                model.model.embed_tokens.unrepack()
        ids = prompt_ids(tok)
        # Stock MLX's CPU quantized matmul is ~10x slower: fewer rounds.
        reps = a.reps if impl != "mlx" else 2
        row = {"impl": impl, "prompt": len(ids), "prefill_tps": prefill_tps(model, ids, reps)}
        d = decode_tps(model, ids, a.steps if impl != "mlx" else max(4, a.steps // 4), reps)
        row.update(decode_plain_tps=d["plain"], decode_compiled_tps=d["compiled"],
                   decode_plain_best_tps=d["plain_best"], decode_compiled_best_tps=d["compiled_best"],
                   compiled_over_plain=d["compiled"] / d["plain"] if d["compiled"] else None,
                   first_step_s=d["first_step_s"])
        rows.append(row)
        fmt = lambda v, f: "refused" if v is None else format(v, f)  # noqa: E731
        print(f"{impl:14} prefill {row['prefill_tps']:7.1f} tok/s   decode plain {row['decode_plain_tps']:6.1f}"
              f"  compiled {fmt(row['decode_compiled_tps'], '6.1f')} tok/s (fastest token "
              f"{row['decode_plain_best_tps']:.1f} / {fmt(row['decode_compiled_best_tps'], '.1f')} tok/s; "
              f"first compiled step {fmt(row['first_step_s'], '.2f')} s)", flush=True)
        del model
    res = {"model": "SmolLM2-135M Q4_1 (GGUF)", "steps": a.steps, "reps": a.reps,
           "clock": "time.process_time, 1 thread (mixbits set_max_threads(1), OPENBLAS_NUM_THREADS=1)",
           "load_average": os.getloadavg()[0],
           "llama_cpp_reference": "75-81 tok/s decode, 1 thread, same GGUF, measured earlier on this kind "
                                  "of host (not in this run)",
           "rows": rows}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"saved {a.out}")


if __name__ == "__main__":
    main()
