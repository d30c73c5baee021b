"""``mixbits quantize``'s work on SmolLM2-135M split into CPU seconds: the
Replayer's reference pass (its ``__init__``), the X^T X asks
(``input_hessian``), the layer builds (``build_layer``) and the save; then
a sha256 of each saved file and of each array (``OUT.digests.json``), so
two code versions' folders can be compared bit for bit.

    env MIXBITS_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MLX_NUM_THREADS=1 \\
        python bench/quantize_stage_time.py --tokens T.npy --allocation A.json --out DIR [--tree SNAPSHOT/python]

``--tree``: import mixbits from another checkout's ``python`` folder (e.g.
``git archive`` of an older commit with the built ``_ext`` copied in), for
the before side of a comparison. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", required=True, help="calibration token ids .npy [n_seq, seq_len]")
    ap.add_argument("--allocation", required=True)
    ap.add_argument("--out", required=True, help="folder to save the quantized model in")
    ap.add_argument("--tree", help="a checkout's python/ folder to import mixbits from")
    args = ap.parse_args()
    if args.tree:
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildRedirectingFinder"]
        sys.path.insert(0, args.tree)
    import mlx.core as mx
    import numpy as np

    import mixbits
    from mixbits.commands.quantize import allocation_candidates, quantize_candidates
    from mixbits.formats.allocation import Allocation
    from mixbits.measure import candidates, replay

    cpu = {"replayer_init": 0.0, "hessians": 0.0, "builds": 0.0}

    def timed(owner, name, key):
        f = getattr(owner, name)

        def run(*a, **k):
            c = time.process_time()
            try:
                return f(*a, **k)
            finally:
                cpu[key] += time.process_time() - c

        setattr(owner, name, run)

    timed(replay.Replayer, "__init__", "replayer_init")
    timed(replay.Replayer, "input_hessian", "hessians")
    timed(candidates, "build_layer", "builds")
    tokens = np.load(args.tokens)
    alloc = Allocation.load(args.allocation)
    model, tokenizer, config = mixbits.load("smollm2", lazy=True)
    load0 = os.getloadavg()
    c0 = time.process_time()
    done = quantize_candidates(model, allocation_candidates(alloc, model), tokens=tokens,
                               embed_bits=alloc.embed_bits)
    c_q = time.process_time() - c0
    c0 = time.process_time()
    mixbits.save(model, args.out, config, tokenizer)
    c_save = time.process_time() - c0
    digests = {}
    for f in sorted(os.listdir(args.out)):
        if f.endswith(".safetensors"):
            path = os.path.join(args.out, f)
            with open(path, "rb") as fh:
                digests[f] = hashlib.sha256(fh.read()).hexdigest()
            for k, v in sorted(mx.load(path).items()):
                digests[f"{f}:{k}"] = hashlib.sha256(np.array(v.view(mx.uint8)).tobytes()).hexdigest()[:16]
    with open(args.out.rstrip("/") + ".digests.json", "w") as fh:
        json.dump(digests, fh, indent=0)
    print(json.dumps({
        "mixbits": mixbits.__file__, "tokens": list(tokens.shape), "tensors": len(done),
        "cpu_s": {"quantize_candidates": round(c_q, 2), **{k: round(v, 2) for k, v in cpu.items()},
                  "save": round(c_save, 2)},
        "loadavg_start": load0, "loadavg_end": os.getloadavg(),
        "threads": {k: os.environ.get(k) for k in ("MIXBITS_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                   "OMP_NUM_THREADS", "MLX_NUM_THREADS")},
        "files": {k: v for k, v in digests.items() if ":" not in k},
    }), flush=True)


if __name__ == "__main__":
    main()
