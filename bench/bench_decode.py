"""SmolLM2-135M Q4_1 end to end, one thread, CPU time: prefill (64 tokens)
and decode tokens/s, plain decode (``model(token, cache)``) next to the
compiled decode (``mixbits.decode.Decoder``), for stock MLX quantized
layers and for mixbits layers (``mixbits.patch``).

    OPENBLAS_NUM_THREADS=1 python bench/bench_decode.py [--steps 16] [--reps 5]

Decode: greedy steps after the 64-token prompt, median per-token CPU time
over ``--reps`` rounds of ``--steps`` tokens, plain and compiled rounds
interleaved. The compiled Decoder is made once per model (its one-off
trace and first-step check are not timed; they are reported as
``first_step_s``, CPU seconds). Saves bench/results/decode.json.
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

from decode_profile import RESULTS, Compiled, Plain, load_smollm2, prompt_ids, setup_cpu_one_thread, time_steps


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
    capacity = len(ids) + (steps + 4) * reps + 8
    modes = [Plain(model, ids, capacity), Compiled(model, ids, capacity)]
    nxt = {m.name: mx.argmax(m.first[:, -1:], axis=-1) for m in modes}
    t0 = time.process_time()
    _, _, nxt["compiled"] = time_steps(modes[1], nxt["compiled"], 1)  # trace + check
    first = time.process_time() - t0
    _, _, nxt["plain"] = time_steps(modes[0], nxt["plain"], 1)
    per = {m.name: [] for m in modes}
    for _ in range(reps):
        for m in modes:
            b, e, nxt[m.name] = time_steps(m, nxt[m.name], steps)
            per[m.name].extend(x + y for x, y in zip(b, e))
    out = {name: 1 / statistics.median(v) for name, v in per.items()}
    out["first_step_s"] = first
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--impl", nargs="+", default=["mlx", "mixbits"], choices=["mlx", "mixbits"])
    ap.add_argument("--out", default=str(RESULTS / "decode.json"))
    a = ap.parse_args(argv)
    setup_cpu_one_thread()
    rows = []
    for impl in a.impl:
        model, tok = load_smollm2(patch=impl == "mixbits")
        ids = prompt_ids(tok)
        # Stock MLX's CPU quantized matmul is ~10x slower: fewer rounds.
        reps = a.reps if impl == "mixbits" else max(2, a.reps // 2)
        row = {"impl": impl, "prompt": len(ids), "prefill_tps": prefill_tps(model, ids, reps)}
        d = decode_tps(model, ids, a.steps if impl == "mixbits" else max(4, a.steps // 4), reps)
        row.update(decode_plain_tps=d["plain"], decode_compiled_tps=d["compiled"],
                   compiled_over_plain=d["compiled"] / d["plain"], first_step_s=d["first_step_s"])
        rows.append(row)
        print(f"{impl:8} prefill {row['prefill_tps']:7.1f} tok/s   decode plain {row['decode_plain_tps']:6.1f}"
              f"  compiled {row['decode_compiled_tps']:6.1f} tok/s ({row['compiled_over_plain']:.2f}x; "
              f"first compiled step {row['first_step_s']:.2f} s)", flush=True)
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
