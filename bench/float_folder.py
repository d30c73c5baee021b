"""Build a random-weight float Llama folder of a real model's shapes, for
benches that need a float checkpoint too large to keep in memory (issue 40:
an 8B-class model through `mixbits convert` on a 24 GiB machine).

    python bench/float_folder.py --shape llama3-8b --dtype bfloat16 --out /tmp/llama8b

The tensor names and shapes are those of mlx-lm's own Llama class (read from
an unevaluated instance, so nothing is allocated); each tensor is drawn,
cast and written shard by shard, so the peak memory is one shard, not the
model. The weights are N(0, 0.02) (norms 1): a model whose forward is
numerically sane, not a trained one. Token ids for calibration are written
beside it (tokens.npy), since the folder has no tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mixbits.streaming import peak_rss

SHAPES = {
    # Llama-3-8B: 8.03B parameters, 16.1 GB in bfloat16.
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      rope_theta=500000.0, tie_word_embeddings=False),
    # TinyLlama-like 1.03B (issue 40's 1B float case).
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=20, intermediate_size=5632,
                     num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                     rope_theta=10000.0, tie_word_embeddings=False),
}


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of mlx-lm's Llama with ``cfg``,
    without allocating: MLX's initialisers are lazy until evaluated."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, **cfg))
    return [(k, tuple(v.shape)) for k, v in tree_flatten(model.parameters())]


def write_folder(out: Path, cfg: dict, dtype: str, shard_bytes: int = 2 << 30, seed: int = 0) -> dict:
    out.mkdir(parents=True, exist_ok=False)
    dt = getattr(mx, dtype)
    rng = np.random.default_rng(seed)  # numpy's normals: ~10x MLX's on the CPU
    shapes = tensor_shapes(cfg)
    shards, current, size = [], {}, 0

    def flush():
        nonlocal current, size
        if current:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            mx.save_safetensors(str(out / name), current, metadata={"format": "mlx"})
            shards.append((name, list(current)))
            current, size = {}, 0

    t0 = time.perf_counter()
    total = 0
    for name, shape in shapes:
        if name.endswith("norm.weight"):
            w = mx.ones(shape, dtype=dt)
        else:
            w = mx.array(rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)).astype(dt)
        mx.eval(w)
        current[name] = w
        nbytes = w.nbytes
        size += nbytes
        total += nbytes
        if size >= shard_bytes:
            flush()
    flush()
    index = {"metadata": {"total_size": total},
             "weight_map": {k: f for f, keys in shards for k in keys}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5,
              "torch_dtype": dtype, **cfg}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    n_params = sum(int(np.prod(s)) for _, s in shapes)
    return {"params": n_params, "bytes": total, "shards": len(shards), "seconds": time.perf_counter() - t0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-seq", type=int, default=8, help="calibration sequences written to tokens.npy")
    ap.add_argument("--seq-len", type=int, default=256)
    a = ap.parse_args(argv)
    mx.set_default_device(mx.cpu)
    out = Path(a.out)
    cfg = SHAPES[a.shape]
    info = write_folder(out, cfg, a.dtype)
    rng = np.random.default_rng(1)
    np.save(out / "tokens.npy", rng.integers(0, cfg["vocab_size"], size=(a.n_seq, a.seq_len)))
    peak = peak_rss() / 2**30
    print(f"{a.shape} {a.dtype}: {info['params'] / 1e9:.2f}B parameters, {info['bytes'] / 1e9:.1f} GB in "
          f"{info['shards']} shards, {info['seconds']:.0f} s, peak RSS {peak:.1f} GiB -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
