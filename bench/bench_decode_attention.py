"""One decode step's attention over a KV cache, one thread, CPU time:
mixbits' kernel with ``kv_len`` (how the compiled decode step calls it),
MLX's ``mx.fast.scaled_dot_product_attention`` on the cache sliced to the
filled length (how mlx-lm calls it), numpy/OpenBLAS in float32 (GQA by
reshaping the query heads), and the bound: the K and V bytes read at the
rate of the read-bandwidth probe in the same run.

    OPENBLAS_NUM_THREADS=1 python bench/bench_decode_attention.py [--reps 9]

Each graph runs the call for ``LAYERS`` layers with their own cache
buffers, as a real step does: at long contexts the caches (30 x K and V)
are larger than the last-level cache and stream from memory, which the
same buffer timed in a loop would hide. Head layouts: SmolLM2-135M's
(9 query heads over 3 KV heads, head dim 64) and a Qwen3-0.6B-like one
(16 over 8, head dim 128). float32 and bfloat16 caches (numpy: float32
only). Reports the median per call over the rounds, and GB/s of K and V.
A round times what a plain step does per layer: MLX's and our calls
include building their graph node (a few us), numpy its Python calls.
Saves bench/results/decode_attention.json.
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
import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS = 30
LAYOUTS = {"smollm2": (9, 3, 64), "qwen3_0.6b": (16, 8, 128)}  # query heads, KV heads, head dim
CONTEXTS = [128, 512, 2048]
SCALE = 0.125


def caches(hk: int, d: int, n: int, dtype, rng):
    """LAYERS pairs of (1, hk, n + 32, d) buffers: a decode step's filled
    prefix of n keys in a buffer with room to grow, as mixbits.decode keeps."""
    shape = (1, hk, n + 32, d)
    out = [tuple(mx.array(rng.standard_normal(shape, dtype=np.float32)).astype(dtype) for _ in range(2))
           for _ in range(LAYERS)]
    mx.eval(out)
    return out


def per_call_s(run, reps: int) -> float:
    """Median CPU seconds per call: each rep runs (and evaluates) one step's
    LAYERS calls."""
    run()
    times = []
    for _ in range(reps):
        t = time.process_time()
        run()
        times.append((time.process_time() - t) / LAYERS)
    return statistics.median(times)


def evaluated(outs: list) -> list:
    mx.eval(outs)
    return outs


def case(name: str, layout, n: int, dtype, reps: int, probe: float, rng) -> dict:
    from mixbits.attention import causal_attention

    h, hk, d = layout
    kv = caches(hk, d, n, dtype, rng)
    q = mx.array(rng.standard_normal((1, h, 1, d), dtype=np.float32)).astype(dtype)
    kv_len = mx.array([n], dtype=mx.int32)
    # Each returns the LAYERS outputs, evaluated: what is timed is what is checked.
    impls = {
        "mixbits": lambda: evaluated([causal_attention(q, k, v, SCALE, kv_len=kv_len) for k, v in kv]),
        "mlx": lambda: evaluated([mx.fast.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], scale=SCALE)
                                  for k, v in kv]),
    }
    if dtype == mx.float32:
        npkv = [(np.array(k)[0], np.array(v)[0]) for k, v in kv]  # (hk, n + 32, d)
        qg = np.array(q).reshape(hk, h // hk, d) * SCALE

        def numpy_step():
            out = []
            for k, v in npkv:
                s = qg @ k[:, :n].transpose(0, 2, 1)
                p = np.exp(s - s.max(-1, keepdims=True))
                out.append(((p / p.sum(-1, keepdims=True)) @ v[:, :n]).reshape(1, h, 1, d))
            return out

        impls["numpy"] = numpy_step
    # The same answers from each, layer by layer: MLX's op in float32 is the reference.
    want = [np.array(mx.fast.scaled_dot_product_attention(
        *(a.astype(mx.float32) for a in (q, k[:, :, :n], v[:, :, :n])), scale=SCALE)) for k, v in kv]
    err = {impl: max(float(np.max(np.abs(np.array(mx.array(o).astype(mx.float32)) - w)))
                     for o, w in zip(run(), want))
           for impl, run in impls.items()}
    nbytes = 2 * hk * n * d * (4 if dtype == mx.float32 else 2)
    row = {"layout": name, "heads": layout, "context": n, "dtype": str(dtype).split(".")[-1],
           "kv_bytes_per_call": nbytes, "max_abs_diff_vs_mlx_f32": err,
           "bound_us": nbytes / (probe * 1e9) * 1e6}
    for impl, run in impls.items():
        s = per_call_s(run, reps)
        row[f"{impl}_us"] = s * 1e6
        row[f"{impl}_gbps"] = nbytes / s / 1e9
    return row


def main(argv=None):
    from bench_decode import cpu_flags

    from mixbits import _ext
    from mixbits.commands.bench import machine_info, page_policy, probe_gbps

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    ap.add_argument("--out", default=str(RESULTS / "decode_attention.json"))
    a = ap.parse_args(argv)
    mx.set_default_device(mx.cpu)
    _ext.set_max_threads(1)
    print(f"CPU flags: {' '.join(cpu_flags())}; one thread, CPU time; {LAYERS} layers per graph")
    probe = probe_gbps()
    print(f"read-bandwidth probe: {probe:.1f} GB/s")
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'layout':>11} {'ctx':>5} {'dtype':>8} {'bound':>7} {'mixbits':>8} {'mlx':>8} {'numpy':>8}   us/call"
          f" (mixbits GB/s)")
    for name, layout in LAYOUTS.items():
        for dtype in (mx.float32, mx.bfloat16):
            for n in a.contexts:
                r = case(name, layout, n, dtype, a.reps, probe, rng)
                rows.append(r)
                npy = f"{r['numpy_us']:8.1f}" if "numpy_us" in r else f"{'-':>8}"
                print(f"{name:>11} {n:>5} {r['dtype']:>8} {r['bound_us']:7.1f} {r['mixbits_us']:8.1f} "
                      f"{r['mlx_us']:8.1f} {npy}   ({r['mixbits_gbps']:.1f})")
    out = {"machine": machine_info(page_policy()), "cpu_flags": cpu_flags(), "probe_gbps": probe,
           "layers_per_graph": LAYERS, "reps": a.reps, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
