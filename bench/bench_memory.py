"""Peak memory (RSS) of mixbits' long commands against the model's size.

Builds a random-weight llama folder with mlx-lm's own model class (default:
hidden 1536, 12 layers, vocab 32000, float16: 0.74 GiB on disk; 8 x 128
random calibration tokens), then runs each command in its own process
(measure exact / grad / two-stage, allocate, quantize, convert; candidates
4b_g64 3b_g64, the exact sweeps on two tensors), which prints its own peak
resident set (VmHWM, read after the command returns) for this script to
collect. The commands also end with their own "peak memory" line.

    python bench/bench_memory.py                   # the default model, every command
    python bench/bench_memory.py --label after --out bench/results/memory_peaks.json
    python bench/bench_memory.py --keep /tmp/mem --only "measure exact"   # reuse a built model

Results go to --out under --label (so "before" and "after" runs of one
model sit side by side), with the host and its load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GiB = 1024 ** 3


def build_folder(folder: Path, hidden: int, layers: int, vocab: int, dtype: str, seed: int = 0) -> None:
    """A random llama folder (mixbits.save of mlx-lm's llama.Model) and tokens.npy beside it."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_map
    from mlx_lm.models import llama

    import mixbits

    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=hidden * 8 // 3 // 64 * 64, num_attention_heads=hidden // 128,
                           num_key_value_heads=max(1, hidden // 512), rms_norm_eps=1e-5,
                           vocab_size=vocab, tie_word_embeddings=False)
    mx.random.seed(seed)
    model = llama.Model(args)
    model.update(tree_map(lambda v: v.astype(getattr(mx, dtype)), model.parameters()))
    mx.eval(model.parameters())
    cfg = {k: v for k, v in vars(args).items() if v is not None}
    cfg["torch_dtype"] = dtype
    mixbits.save(model, folder, cfg)
    rng = np.random.default_rng(seed)
    np.save(folder.parent / "tokens.npy", rng.integers(0, vocab, size=(8, 128)))


def child(argv: list[str]) -> int:
    """Run one mixbits command in this process, then print its peak."""
    from mixbits.cli import main as mixbits_main
    from mixbits.streaming import peak_rss

    rc = mixbits_main(argv)
    print(f"BENCH_PEAK {peak_rss()}", flush=True)
    return rc


def peak_of(argv: list[str]) -> tuple[int, float, int, str]:
    """(peak RSS bytes, seconds, return code, output tail) of ``mixbits argv`` run alone."""
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True)
    out = run.stdout + run.stderr
    peaks = [int(line.split()[1]) for line in run.stdout.splitlines() if line.startswith("BENCH_PEAK ")]
    return (peaks[-1] if peaks else -1), time.perf_counter() - t0, run.returncode, out[-2000:]


def commands(work: Path, model: Path, tokens: Path, sites: list[str]) -> dict[str, tuple]:
    """name -> (argv, the outputs it writes: removed before it runs)."""
    mb = []
    few = ["--tensors", *sites]
    src = ["--model", str(model), "--tokens", str(tokens)]
    cands = ["--candidates", "4b_g64", "3b_g64"]
    alloc = work / "alloc.json"
    return {
        "measure exact": (mb + ["measure", *src, "--method", "exact", *cands, *few,
                                "--out", str(work / "exact.json")], ["exact.json"]),
        "measure grad": (mb + ["measure", *src, "--method", "grad", *cands,
                               "--out", str(work / "grad.json")], ["grad.json"]),
        "measure two-stage": (mb + ["measure", *src, "--method", "two-stage", *cands, *few,
                                    "--targets", "4.0", "--out", str(work / "two.json")],
                              ["two.json", "two.json.exact.json"]),
        "allocate": (mb + ["allocate", str(work / "grad.json"), "--bpw", "4.0", "--out", str(alloc)],
                     ["alloc.json"]),
        "quantize": (mb + ["quantize", "--model", str(model), "--allocation", str(alloc),
                           "--out", str(work / "q")], ["q"]),
        "convert": (mb + ["convert", *src, "--bpw", "4.0", "--method", "grad", *cands,
                          "--max-evals", "2", "--out", str(work / "c")], ["c", "c.work"]),
    }


def record(out: Path, args, size: int, row: dict) -> None:
    """Add ``row`` to ``out`` under ``args.label`` (replacing the same command's)."""
    data = json.loads(out.read_text()) if out.exists() else {}
    rows = [r for r in data.get(args.label, {}).get("rows", []) if r["command"] != row["command"]]
    data[args.label] = {
        "model": {"arch": "llama", "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                  "dtype": args.dtype, "weights_bytes": size, "tokens": [8, 128]},
        "host": {"machine": platform.machine(), "system": platform.system(), "cpus": os.cpu_count(),
                 "load_average": [round(x, 1) for x in os.getloadavg()], "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "rows": rows + [row],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1:])
    if argv[:1] == ["--build"]:
        hidden, layers, vocab = map(int, argv[2:5])
        build_folder(Path(argv[1]), hidden, layers, vocab, argv[5])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--only", nargs="+", help="run only these commands (names as printed)")
    ap.add_argument("--label", default="run", help="key the results go under in --out")
    ap.add_argument("--out", help="JSON file to add the results to (e.g. bench/results/memory_peaks.json)")
    ap.add_argument("--keep", metavar="DIR", help="build (or reuse) the model here instead of a temp folder")
    args = ap.parse_args(argv)

    tmp = tempfile.TemporaryDirectory(prefix="mixbits-mem-") if not args.keep else None
    root = Path(args.keep or tmp.name)
    model = root / "model"
    if not (model / "config.json").exists():
        # Built in another process: this one stays small (it only waits).
        subprocess.run([sys.executable, __file__, "--build", str(model), str(args.hidden),
                        str(args.layers), str(args.vocab), args.dtype], check=True)
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {args.dtype}: "
          f"{size / GiB:.2f} GiB of weights on disk", flush=True)
    mid = args.layers // 2
    sites = [f"model.layers.{mid}.mlp.down_proj", f"model.layers.{mid}.self_attn.o_proj"]
    work = root / "work"
    # "allocate" reads grad's table and "quantize" allocate's allocation.
    for name, spec in commands(work, model, root / "tokens.npy", sites).items():
        if args.only and name not in args.only:
            continue
        cmd, outputs = spec
        work.mkdir(exist_ok=True)
        for o in outputs:
            subprocess.run(["rm", "-rf", str(work / o)], check=True)
        peak, secs, rc, tail = peak_of(cmd)
        if rc != 0:
            print(tail)
            raise SystemExit(f"{name} failed (exit {rc})")
        print(f"{name:18s} peak {peak / GiB:6.2f} GiB ({peak / size:4.2f}x the weights), {secs:6.1f} s",
              flush=True)
        row = {"command": name, "peak_rss_bytes": peak, "peak_rss_gib": round(peak / GiB, 3),
               "x_weights": round(peak / size, 3), "seconds": round(secs, 1)}
        if args.out:  # after every command: a failure later keeps what was measured
            record(Path(args.out), args, size, row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
