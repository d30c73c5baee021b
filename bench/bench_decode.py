"""SmolLM2-135M Q4_1 end to end, one thread, CPU time and wall clock: prefill (64 tokens)
and decode tokens/s, plain decode (``model(token, cache)``) next to the
compiled decode (``mixbits.decode.Decoder``), for stock MLX quantized
layers and for mixbits layers (``mixbits.patch``).

    OPENBLAS_NUM_THREADS=1 python bench/bench_decode.py [--steps 32] [--reps 4]
        [--llama-bench build/ggml/llama-bench]

Decode: median per-token CPU time over ``--reps`` interleaved rounds, each
a fresh prefill of the 64-token prompt then 2 untimed + ``--steps`` timed
greedy steps (bench/decode_profile.py's rounds), and the fastest token
(``*_best``: noise only adds time). The compiled step's one-off trace and
check (its first step) are untimed there and reported as ``first_step_s``
(CPU seconds). Every rate of ours is also taken by the wall clock
(``*_wall_tps``: time.perf_counter around the same calls).

With ``--llama-bench PATH`` (bench/ggml/build_llama_bench.sh builds it),
llama.cpp's llama-bench runs in the same run on the same GGUF file, one
thread, ``pp64`` (from an empty cache) and ``tg<steps>`` after a 64-token
context, before and after our implementations (bench/llama_bench.py): its
own wall-clock rates, and its CPU-time rates from getrusage of its
processes.

``--context N`` replaces the 64-token prompt (and llama.cpp's prefill and
decode depth) with N tokens: decode at a long context, where every step
reads the whole KV cache (ours float32 like the model; llama.cpp's float16).
Saves bench/results/decode.json.
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

import llama_bench
from decode_profile import (PROMPT, RESULTS, WARM, Compiled, Plain, load_smollm2, prompt_ids, setup_cpu_one_thread,
                            warm)


def prefill_tps(model, ids, reps: int, all_logits: bool = False) -> tuple[float, float]:
    """(CPU-time, wall-clock) tokens/s of a prefill from an empty cache up to
    the first token's logits, median of ``reps`` after one untimed.

    As ``mlx_lm.generate`` runs a prompt: all tokens but the last evaluate
    only the cache (MLX never computes the head's logits for them), then the
    last token gives the logits. The same work as llama-bench's pp64, which
    outputs the last token's logits only (common_batch_get_one marks one
    output). ``all_logits``: one ``model(ids)`` call evaluated whole, the
    head on every prompt token (64 rows of 49152 logits: about a fifth of
    SmolLM2's prefill FLOPs that llama.cpp does not run)."""
    from mlx_lm.models.cache import make_prompt_cache

    ts, ws = [], []
    for _ in range(reps + 1):
        cache = make_prompt_cache(model)
        t0, w0 = time.process_time(), time.perf_counter()
        if all_logits:
            mx.eval(model(mx.array([ids]), cache=cache))
        else:
            model(mx.array([ids[:-1]]), cache=cache)
            mx.eval([c.state for c in cache])
            mx.eval(model(mx.array([ids[-1:]]), cache=cache))
        ts.append(time.process_time() - t0)
        ws.append(time.perf_counter() - w0)
    return len(ids) / statistics.median(ts[1:]), len(ids) / statistics.median(ws[1:])


def time_steps(step, nxt, steps: int):
    """(CPU, wall) seconds of each of ``steps`` greedy decode steps (graph
    build + eval, as decode_profile.time_steps sums them)."""
    cpu, wall = [], []
    for _ in range(steps):
        t0, w0 = time.process_time(), time.perf_counter()
        nxt = mx.argmax(step(nxt)[:, -1:], axis=-1)
        mx.eval(nxt)
        cpu.append(time.process_time() - t0)
        wall.append(time.perf_counter() - w0)
    return cpu, wall


def rounds(model, ids, kinds, steps: int, reps: int) -> dict:
    """{kind name: (CPU seconds, wall seconds) of every timed step}: ``reps``
    interleaved rounds, each from a fresh prefill of ``ids``, of WARM
    untimed + ``steps`` timed greedy steps (decode_profile.rounds with both
    clocks)."""
    capacity = len(ids) + WARM + steps + 1
    samples = {k.name: ([], []) for k in kinds}
    for _ in range(reps):
        for k in kinds:
            m = k(model, ids, capacity)
            c, w = time_steps(m, warm(m, WARM), steps)
            samples[k.name][0].extend(c)
            samples[k.name][1].extend(w)
    return samples


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
    out = {"compiled": None, "compiled_best": None, "compiled_wall": None, "first_step_s": None}
    for name, (per, wall) in samples.items():
        out[name], out[f"{name}_best"] = 1 / statistics.median(per), 1 / min(per)
        out[f"{name}_wall"] = 1 / statistics.median(wall)
    if out["compiled"] is not None:
        # The one-off cost of a compiled generation's first step (trace + check).
        m = Compiled(model, ids, len(ids) + 8)
        t0 = time.process_time()
        warm(m, 1)
        out["first_step_s"] = time.process_time() - t0
    return out


def cpu_flags() -> list[str]:
    """The SIMD flags of /proc/cpuinfo the kernels (ours and ggml's) choose by."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                want = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                        "avx512_bf16", "amx_int8"]
                return [f for f in want if f in have]
    except OSError:
        pass
    import platform

    return [platform.machine()]


def set_activations(model, act: str) -> None:
    """Every mixbits linear layer (and the tied head) on contract `act`."""
    import mixbits

    kinds = (mixbits.nn.MixedQuantizedLinear, mixbits.nn.MixedQuantizedEmbedding)
    layers = [m for _, m in model.named_modules() if isinstance(m, kinds)]
    if not layers:
        raise SystemExit("no mixbits layers to set activations on")
    for m in layers:
        m.activations = act


def one_round(rnd: int, rows: list, run_llama, a) -> None:
    """llama.cpp, then every implementation, then llama.cpp again."""
    run_llama("before", rnd + 1)
    for impl in a.impl:
        model, tok = load_smollm2(patch=impl.startswith("mixbits"))
        if "-" in impl:
            set_activations(model, impl.split("-")[1].replace("int8all", "int8-all"))
        if "-repacked" in impl:
            import mixbits

            print(f"repacked {len(mixbits.nn.repack_layers(model))} layers", flush=True)
            if impl.endswith("-linears"):
                model.model.embed_tokens.unrepack()
        ids = prompt_ids(tok, a.context)
        # Stock MLX's CPU quantized matmul is ~10x slower: fewer rounds.
        reps = a.reps if impl != "mlx" else 2
        pf_cpu, pf_wall = prefill_tps(model, ids, reps)
        pfa_cpu, pfa_wall = prefill_tps(model, ids, reps, all_logits=True)
        row = {"impl": impl, "prompt": len(ids), "prefill_tps": pf_cpu, "prefill_wall_tps": pf_wall,
               "prefill_all_logits_tps": pfa_cpu, "prefill_all_logits_wall_tps": pfa_wall}
        d = decode_tps(model, ids, a.steps if impl != "mlx" else max(4, a.steps // 4), reps)
        row.update(decode_plain_tps=d["plain"], decode_compiled_tps=d["compiled"],
                   decode_plain_best_tps=d["plain_best"], decode_compiled_best_tps=d["compiled_best"],
                   decode_plain_wall_tps=d["plain_wall"], decode_compiled_wall_tps=d["compiled_wall"],
                   compiled_over_plain=d["compiled"] / d["plain"] if d["compiled"] else None,
                   first_step_s=d["first_step_s"], load_average=os.getloadavg()[0], round=rnd + 1)
        rows.append(row)
        fmt = lambda v, f: "refused" if v is None else format(v, f)  # noqa: E731
        print(f"{impl:14} prefill {row['prefill_tps']:7.1f} tok/s CPU ({pf_wall:.1f} wall; all {len(ids)} rows "
              f"of logits {pfa_cpu:.1f} CPU)   decode plain "
              f"{row['decode_plain_tps']:6.1f}  compiled {fmt(row['decode_compiled_tps'], '6.1f')} tok/s CPU "
              f"({row['decode_plain_wall_tps']:.1f} / {fmt(row['decode_compiled_wall_tps'], '.1f')} wall; "
              f"fastest token {row['decode_plain_best_tps']:.1f} / {fmt(row['decode_compiled_best_tps'], '.1f')} "
              f"tok/s; first compiled step {fmt(row['first_step_s'], '.2f')} s)", flush=True)
        del model
    run_llama("after", rnd + 1)


def round_ratios(rows: list) -> dict:
    """Per implementation: each round's CPU-time rate over llama.cpp's in
    that round (the mean of its before/after runs), for prefill and the
    compiled decode; median and range over the rounds."""
    out = {}
    by_round = {}
    for r in rows:
        by_round.setdefault(r.get("round", 1), []).append(r)
    for rnd, rs in sorted(by_round.items()):
        ll = [r for r in rs if r["impl"] == "llama.cpp" and r["prefill_tps"] and r["decode_tps"]]
        if not ll:
            continue
        ref = {k: statistics.mean(r[k] for r in ll) for k in ("prefill_tps", "decode_tps")}
        for r in rs:
            if r["impl"] == "llama.cpp" or r.get("decode_compiled_tps") is None:
                continue
            d = out.setdefault(r["impl"], {"prefill": [], "prefill_all_logits": [], "decode_compiled": []})
            d["prefill"].append(r["prefill_tps"] / ref["prefill_tps"])
            d["prefill_all_logits"].append(r["prefill_all_logits_tps"] / ref["prefill_tps"])
            d["decode_compiled"].append(r["decode_compiled_tps"] / ref["decode_tps"])
    for d in out.values():
        for k in [k for k in d if not d[k]]:
            del d[k]
        for k in list(d):
            v = d[k]
            d[k] = {"per_round": [round(x, 3) for x in v], "median": round(statistics.median(v), 3),
                    "min": round(min(v), 3), "max": round(max(v), 3)}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--impl", nargs="+", default=["mlx", "mixbits"],
                    choices=["mlx", "mixbits", "mixbits-int8", "mixbits-int16", "mixbits-int8-repacked",
                             "mixbits-int16-repacked", "mixbits-int8-repacked-linears",
                             "mixbits-int16-repacked-linears", "mixbits-int8all-repacked"],
                    help="mixbits-int8/-int16: the patched model with that activations= contract; "
                         "-repacked: that contract with the linear layers and the tied head's table in the "
                         "row-interleaved layout (mixbits.nn.repack_layers); -repacked-linears: the same "
                         "with the tied head left in MLX's layout; mixbits-int8all-repacked: "
                         "activations='int8-all' (the int8 contract for prompts too), repacked")
    ap.add_argument("--out", default=str(RESULTS / "decode.json"))
    ap.add_argument("--context", type=int, default=PROMPT,
                    help="prompt tokens before the decode steps (llama.cpp: -p and -d of this many): "
                         "decode at a long context reads a KV cache larger than the caches")
    ap.add_argument("--llama-bench", metavar="PATH",
                    help="llama.cpp's llama-bench (bench/ggml/build_llama_bench.sh): run it on the same GGUF, "
                         "one thread, before and after our implementations")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the whole comparison (llama.cpp, ours, llama.cpp) this many times and report "
                         "each round's ratio to llama.cpp: on a shared host single runs move by 20-30%%")
    ap.add_argument("--llama-reps", type=int, default=10,
                    help="llama-bench --repetitions per test (its CPU time: this run minus a -r 1 run)")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        raise SystemExit("error: --rounds must be at least 1")
    if not 1 <= a.context <= 8192 - a.steps - 16:  # SmolLM2's 8192 positions, with room for the steps
        raise SystemExit(f"error: --context must be in [1, {8192 - a.steps - 16}], got {a.context}")
    llama = gguf = None
    if a.llama_bench is not None:  # one clear error before anything is timed
        if a.llama_reps < 2:
            raise SystemExit("error: --llama-reps must be at least 2 (CPU time is a difference of two runs)")
        try:
            llama = llama_bench.check_executable(a.llama_bench)
            llama_version = llama_bench.check_runs(llama)
        except llama_bench.LlamaBenchError as e:
            raise SystemExit(f"error: {e}") from None
        from mixbits.models import smollm2

        gguf = str(smollm2.fetch())
    flags = cpu_flags()
    from mixbits import ops

    backends = ops.available_backends()  # what the kernels may use (MIXBITS_ISA=avx2 caps it)
    print(f"load average {os.getloadavg()}; CPU flags: {' '.join(flags)}; "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}; "
          f"mixbits backends: {', '.join(backends)} (MIXBITS_ISA={ops.isa_limit()})",
          flush=True)
    setup_cpu_one_thread()
    rows, llama_runs = [], []

    def run_llama(when: str, rnd: int) -> None:
        if llama is None:
            return
        try:
            m = llama_bench.measure(llama, gguf, a.context, a.steps, a.llama_reps)
        except llama_bench.LlamaBenchError as e:
            raise SystemExit(f"error: {e}") from None
        pf, dc = m["prefill"], m["decode"]
        row = {"impl": "llama.cpp", "when": when, "prompt": pf["test"]["n_prompt"],
               "prefill_tps": pf["cpu_tps"], "prefill_wall_tps": pf["test"]["wall_median_tps"],
               "decode_tps": dc["cpu_tps"], "decode_wall_tps": dc["test"]["wall_median_tps"],
               "decode_wall_best_tps": dc["test"]["wall_best_tps"],
               "prefill_llama_avg_ts": pf["test"]["avg_ts"], "decode_llama_avg_ts": dc["test"]["avg_ts"],
               "decode_depth": dc["test"]["n_depth"], "decode_steps": dc["test"]["n_gen"],
               "cpu_over_wall": {"prefill": pf["cpu_over_wall"], "decode": dc["cpu_over_wall"]},
               "load_average": os.getloadavg()[0], "round": rnd}
        rows.append(row)
        llama_runs.append({"when": when, "round": rnd, **m})
        num = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731  (CPU time lost in the noise)
        print(f"{'llama.cpp':14} prefill {num(row['prefill_tps']):>7} tok/s CPU ({row['prefill_wall_tps']:.1f} wall)"
              f"   decode {num(row['decode_tps']):>6} tok/s CPU ({row['decode_wall_tps']:.1f} wall; tg{a.steps} "
              f"at depth {a.context}) [{when}, round {rnd}, load {row['load_average']:.2f}]", flush=True)

    for rnd in range(a.rounds):
        one_round(rnd, rows, run_llama, a)
    res = {"model": "SmolLM2-135M Q4_1 (GGUF)", "context": a.context, "steps": a.steps, "reps": a.reps, "rounds": a.rounds,
           "clock": "prefill_tps/decode_*_tps: CPU time (ours: time.process_time; llama.cpp: getrusage of its "
                    "processes, -r R run minus -r 1 run); *_wall_tps: wall clock (ours: time.perf_counter; "
                    "llama.cpp: its samples_ns); 1 thread (mixbits set_max_threads(1), OPENBLAS_NUM_THREADS=1, "
                    "llama-bench -t 1)",
           "load_average": os.getloadavg()[0], "cpu_flags": flags, "mixbits_backends": backends,
           "mixbits_isa": ops.isa_limit(), "rows": rows}
    ratios = round_ratios(rows)
    if ratios:
        res["vs_llama_cpp_cpu"] = ratios
        for impl, d in ratios.items():
            print(f"{impl}: CPU-time rate / llama.cpp's per round: prefill {d['prefill']['per_round']} "
                  f"(median {d['prefill']['median']}; all logits {d['prefill_all_logits']['per_round']}), "
                  f"compiled decode {d['decode_compiled']['per_round']} "
                  f"(median {d['decode_compiled']['median']})", flush=True)
    if llama is None:
        res["llama_cpp_reference"] = ("75-81 tok/s decode, 1 thread, same GGUF, measured earlier on this kind "
                                      "of host (not in this run; pass --llama-bench to run it)")
    else:
        res["llama_cpp"] = {"llama_bench": llama, "version": llama_version, "gguf": gguf,
                            "reps": a.llama_reps, "runs": llama_runs}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"saved {a.out}")


if __name__ == "__main__":
    main()
