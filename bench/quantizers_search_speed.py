"""quantizers.search: the fused kernel (cpp/quant_search, what ``search``
runs) against the numpy definition it replaced (``search_reference``), one
thread, on LLM-sized weights; checks that both give the same codes, scales
and biases on every shape timed.

Times are CPU seconds of this process (``time.process_time``; one thread:
the numpy reference's OpenBLAS is held to one too), best of ``--repeat``;
the host's CPU, ISA flags and load are printed and saved with them, since
the machine is shared. The reference on a 4096 x 14336 weight holds several
N x K float64 temporaries (~3 GB): ``--ref-max`` caps the elements it is
timed on (larger shapes are timed on their first rows and scaled per weight,
said so in the JSON).

Run:
  OPENBLAS_NUM_THREADS=1 python bench/quantizers_search_speed.py
  -> bench/results/search_speed.json
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mixbits.measure.candidates import parse_candidate  # noqa: E402

S = importlib.import_module("mixbits.quantizers.search")

p = argparse.ArgumentParser()
p.add_argument("--shapes", default="2048x2048,4096x14336")
p.add_argument("--kinds", default="2b_g64,3b_g64,4b_g64,4b10_3b_g64")
p.add_argument("--repeat", type=int, default=1, help="best of this many runs")
p.add_argument("--ref-max", type=int, default=1 << 22, help="most elements the reference is timed on")
p.add_argument("--out", default=str(Path(__file__).parent / "results" / "search_speed.json"))
args = p.parse_args()


def host():
    cpu, flags = platform.processor(), []
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and not cpu.strip():
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni") if f in have]
                break
    except OSError:
        pass
    return {"cpu": cpu, "isa": flags, "cores": os.cpu_count(), "threads": 1,
            "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"), "loadavg_start": os.getloadavg()}


def timed(fn):
    best, out = None, None
    for _ in range(args.repeat):
        t0 = time.process_time()
        out = fn()
        dt = time.process_time() - t0
        best = dt if best is None else min(best, dt)
    return best, out


def same(a, b):
    for x, y in zip(a.segments, b.segments):
        for f in ("wq", "scales", "biases"):
            if not np.array_equal(np.array(getattr(x, f).astype(mx.float32) if f != "wq" else getattr(x, f)),
                                  np.array(getattr(y, f).astype(mx.float32) if f != "wq" else getattr(y, f))):
                return False
    return True


info = host()
print(f"host: {info['cpu']} | ISA {' '.join(info['isa'])} | {info['cores']} cores, 1 thread | "
      f"load {info['loadavg_start'][0]:.2f} {info['loadavg_start'][1]:.2f} {info['loadavg_start'][2]:.2f}")
rows = []
for shape in args.shapes.split(","):
    N, K = map(int, shape.split("x"))
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
    h = (rng.random(K) * np.exp(rng.standard_normal(K) * 2)).astype(np.float64)  # diag(X^T X)-like
    nr = max(1, min(N, args.ref_max // K))
    for kind in args.kinds.split(","):
        segs = parse_candidate(kind).segments(K)
        t_new, q_new = timed(lambda: S.search(w, segs, dtype=mx.bfloat16, h_diag=h))
        wr = w[:nr]
        t_ref, q_ref = timed(lambda: S.search_reference(wr, segs, dtype=mx.bfloat16, h_diag=h))
        t_sub, q_sub = timed(lambda: S.search(wr, segs, dtype=mx.bfloat16, h_diag=h))
        ok = same(q_sub, q_ref)
        ref_full = t_ref * N / nr
        r = {"shape": [N, K], "kind": kind, "dtype": "bfloat16", "new_s": round(t_new, 3),
             "ref_s": round(ref_full, 3), "ref_rows_timed": nr,
             "new_s_on_ref_rows": round(t_sub, 3), "speedup": round(ref_full / t_new, 2),
             "speedup_same_rows": round(t_ref / t_sub, 2),
             "new_us_per_weight": round(t_new / (N * K) * 1e6, 4), "identical": ok}
        rows.append(r)
        print(f"{N}x{K} {kind:12s} new {t_new:7.2f} s  ref {ref_full:7.2f} s"
              f"{'' if nr == N else f' (timed on {nr} rows, scaled)'}  x{r['speedup']:.1f}"
              f"  (same rows x{r['speedup_same_rows']:.1f})  {r['new_us_per_weight']:.4f} us/weight"
              f"  identical={ok}", flush=True)
info["loadavg_end"] = os.getloadavg()
info["date_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
Path(args.out).parent.mkdir(parents=True, exist_ok=True)
tmp = Path(args.out + ".tmp")
tmp.write_text(json.dumps({"host": info, "runs": rows}, indent=1) + "\n")
tmp.replace(args.out)
print(f"load at end {info['loadavg_end'][0]:.2f}; wrote {args.out}")
