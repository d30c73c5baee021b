"""X^T X for quantize's calibrated linears on SmolLM2-135M: one block replay
per tensor (``--mode per-site``: input_hessian(site), what quantize_candidates
asked before f7469a9) against one replay per block (``--mode per-block``:
input_hessian(site, along=every block linear), what it asks now).

Prints one JSON line: the Replayer's reference pass and the X^T X asks,
wall and CPU seconds (CPU is the figure to compare on a loaded host), and a
sha256 prefix per matrix with ``--digests FILE`` (the two modes' files must
match: the matrices are bit-identical).

    nice -n 5 env MIXBITS_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \\
        python bench/quantize_hessians.py --mode per-block --tokens T.npy [--blocks N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("per-site", "per-block"), required=True)
    ap.add_argument("--tokens", required=True, help="calibration token ids .npy (convert's DIR.work/tokens.npy)")
    ap.add_argument("--blocks", type=int, help="the first N blocks only")
    ap.add_argument("--digests", help="write {path: [sha256 prefix, tokens]} here")
    args = ap.parse_args()

    import mixbits
    from mixbits.adapter import ModelAdapter
    from mixbits.measure.candidates import records_input
    from mixbits.measure.replay import Replayer, token_chunks

    model, _, _ = mixbits.load("smollm2", lazy=True)
    ad = ModelAdapter(model)
    tokens = np.load(args.tokens)
    load0 = os.getloadavg()
    w0, c0 = time.perf_counter(), time.process_time()
    rp = Replayer(model, token_chunks(tokens, 4), ad)  # quantize_candidates' chunks
    w1, c1 = time.perf_counter(), time.process_time()
    sites = [s for s in ad.sites if records_input(s)]
    if args.blocks is not None:
        sites = [s for s in sites if s.block < args.blocks]
    digests = {}
    cpu = 0.0
    for s in sites:
        c = time.process_time()
        h, n = rp.input_hessian(s) if args.mode == "per-site" else rp.input_hessian(s, along=sites)
        cpu += time.process_time() - c
        digests[s.path] = [hashlib.sha256(np.ascontiguousarray(h).tobytes()).hexdigest()[:16], int(n)]
    w2 = time.perf_counter()
    if args.digests:
        with open(args.digests, "w") as f:
            json.dump(digests, f, indent=0)
    print(json.dumps({
        "mode": args.mode, "tensors": len(sites), "blocks": len({s.block for s in sites}),
        "tokens": list(tokens.shape),
        "replayer_init": {"wall_s": round(w1 - w0, 2), "cpu_s": round(c1 - c0, 2)},
        "hessians": {"wall_s": round(w2 - w1, 2), "cpu_s": round(cpu, 2)},
        "loadavg_start": load0, "loadavg_end": os.getloadavg(),
        "threads": {k: os.environ.get(k) for k in ("MIXBITS_NUM_THREADS", "OPENBLAS_NUM_THREADS")},
    }), flush=True)


if __name__ == "__main__":
    main()
