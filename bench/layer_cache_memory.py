"""Memory of refine's cache of built layers (issue 40), broken down.

The real ``refine`` (knapsack starts, swaps, baseline guard) on a float
folder loaded as convert loads it (weights left on disk, read per block),
the default six-kind candidate menu, a synthetic sensitivity table as in
bench/joint_reuse.py. Every layer built is recorded with its bytes, so the
cache an unbounded run would hold is known exactly (the sum over distinct
(tensor, candidate) keys: nothing is dropped without a limit) even when
this run is capped to stay small. Prints one JSON object: peak RSS, the
cache's peak and its bytes by candidate, the unbounded cache by candidate,
the block-output store, the reference logits, every joint KL seen.

    python bench/layer_cache_memory.py --folder /tmp/llama1b --layer-limit 1024   # MiB
    python bench/layer_cache_memory.py --layer-limit none                       # unbounded
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

MiB = 1 << 20


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", default="/tmp/llama1b")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--n-seq", type=int, default=2)
    p.add_argument("--bpw", type=float, nargs="+", default=[3.5])
    p.add_argument("--max-evals", type=int, default=4)
    p.add_argument("--layer-limit", default="1024", help="MiB, 'none' or 'auto'")
    args = p.parse_args(argv)

    from mixbits import streaming
    from mixbits.measure import layer_cache
    from mixbits.measure.calib import load_model
    from mixbits.measure.candidates import DEFAULT_CANDIDATES, parse_candidate
    from mixbits.measure.joint import JointEvaluator
    from mixbits.measure.refine import refine

    import mlx.core as mx

    built: dict = {}  # (path, cand) -> bytes, every layer ever put
    put = layer_cache.LayerCache.put
    top = {"rss": 0}  # the sample with the largest resident set

    def sample(where):
        with open("/proc/self/status") as f:
            st = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.startswith("Rss")}
        if st.get("RssAnon", 0) + st.get("RssFile", 0) > top["rss"]:
            top.update(rss=st.get("RssAnon", 0) + st.get("RssFile", 0), where=where,
                       anon_mib=st.get("RssAnon", 0) / MiB, file_mib=st.get("RssFile", 0) / MiB,
                       mlx_active_mib=mx.get_active_memory() / MiB, mlx_cache_mib=mx.get_cache_memory() / MiB)

    def recording_put(self, key, layer):
        put(self, key, layer)
        built[key] = self._items[key][1]
        sample(f"put {key[1]}")

    layer_cache.LayerCache.put = recording_put
    limit = {"none": None, "auto": "auto"}.get(args.layer_limit)
    if args.layer_limit not in ("none", "auto"):
        limit = int(float(args.layer_limit) * MiB)

    model, _ = load_model(types.SimpleNamespace(model=args.folder, dtype=args.dtype))
    tokens = np.load(Path(args.folder) / "tokens.npy")[: args.n_seq]
    rss_loaded = streaming.peak_rss()
    ev = JointEvaluator(model, tokens, chunk=4, layer_limit=limit)
    rss_ev = streaming.peak_rss()
    sites = list(ev.sites.values())
    entries = []
    rng = np.random.default_rng(0)
    for s in sites:  # per-tensor KL = s_i * 4^-bits: the search's moves, not its quality
        sens = float(rng.lognormal(0.0, 1.0))
        cands = []
        for name in DEFAULT_CANDIDATES:
            c = parse_candidate(name)
            bits = c.bits if c.bits is not None else c.storage_bpw  # ternary, mixed kinds
            cands.append({"kind": name, "bits": bits, "kl": sens * 4.0 ** -bits,
                          "storage_bits": int(round(c.storage_bpw * s.nparams))})
        entries.append({"path": s.path, "layer": s.block, "nparams": s.nparams, "candidates": cands})
    table = {"entries": entries}

    seen, store_peak = [], [0]
    inner = ev.joint_kl

    def recording(assignment, chunks=None):
        sample("before an evaluation")
        out = inner(assignment, chunks)
        sample("after an evaluation")
        seen.append(out[0])
        if ev._prefixes is not None:
            store_peak[0] = max(store_peak[0], ev._prefixes.bytes)
        return out

    ev.joint_kl = recording
    t0 = time.perf_counter()
    written = {}
    for b in args.bpw:
        alloc = refine(table, ev, b, max_evals=args.max_evals, progress=False)
        written[str(b)] = alloc["guard"]["written"]
    unbounded: dict = {}
    for (_, cand), n in built.items():
        unbounded[cand] = unbounded.get(cand, 0) + n
    cache = ev._layers
    out = {
        "folder": args.folder, "dtype": args.dtype, "tokens": list(tokens.shape), "budgets": args.bpw,
        "max_evals": args.max_evals, "layer_limit_mib": None if cache.limit is None else cache.limit / MiB,
        "nparams": sum(s.nparams for s in sites), "wall_s": round(time.perf_counter() - t0, 1),
        "load_avg": os.getloadavg(), "written": written,
        "peak_rss_mib": streaming.peak_rss() / MiB, "rss_after_load_mib": rss_loaded / MiB,
        "peak_rss_after_evaluator_mib": rss_ev / MiB,
        "ref_logits_mib": sum(int(x.nbytes) for x in ev.ref_logits) / MiB,
        "block_store_peak_mib": store_peak[0] / MiB,
        "block_store_limit_mib": None if ev._prefixes is None else ev._prefixes.limit / MiB,
        "cache_peak_mib": cache.peak_bytes / MiB, "cache_builds": cache.builds,
        "cache_dropped": cache.dropped, "distinct_layers": len(built),
        "cache_held_by_candidate_mib": {k: v / MiB for k, v in cache.by_candidate().items()},
        "unbounded_cache_by_candidate_mib": {k: v / MiB for k, v in sorted(unbounded.items())},
        "unbounded_cache_mib": sum(unbounded.values()) / MiB,
        "largest_sample": {k: v for k, v in top.items() if k != "rss"} | {"rss_mib": top["rss"] / MiB},
        "mlx_peak_mib": mx.get_peak_memory() / MiB, "mlx_cache_limit_note": "MLX keeps freed buffers",
        "forwards_run": ev.evaluations, "joint_kls": seen,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
