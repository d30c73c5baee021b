"""Decode of a mixture-of-experts model on the CPU, one thread, CPU time:
MLX's own quantized layers next to mixbits' (``mixbits.patch``) with the
float contract, with the int8 one, whose expert stacks run the integer
kernels on each chosen expert's rows (``mixbits.gather_qmatmul``), and
with int8 on repacked weights (``repack=True``: experts included), and
that model again through ``mixbits.decode.Decoder`` (the model's own
forward under ``mx.compile``).

    OPENBLAS_NUM_THREADS=1 python bench/bench_moe_decode.py [--steps 32] [--reps 4]

No MoE model ships in a package on the index, so the model is mlx-lm's own
qwen3_moe class with random weights at the shape of a small real one
(``SHAPE``: hidden 1024, 32 experts of 512, top-8, 8 layers), quantized
by mlx-lm to 4-bit g64 (the router gates at 8 bits). Speed depends on the
shapes, not on the values. Each round: a fresh model call over a 16-token
prompt, then ``--steps`` greedy steps of ``model(token, cache)``; the
models take turns round by round so host load hits all alike.
Reports the median ms per token and per-token expert weight bytes.
Saves bench/results/moe_decode.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = dict(model_type="qwen3_moe", hidden_size=1024, num_hidden_layers=8, intermediate_size=2048,
             num_attention_heads=16, num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-6,
             vocab_size=32000, max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False,
             num_experts=32, num_experts_per_tok=8, moe_intermediate_size=512, decoder_sparse_step=1,
             mlp_only_layers=[], norm_topk_prob=True)
PROMPT = 16


def build(seed: int = 0):
    from mlx_lm.models import qwen3_moe
    from mlx_lm.utils import quantize_model

    mx.random.seed(seed)
    cfg = copy.deepcopy(SHAPE)
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(cfg))
    pred = model.quant_predicate if hasattr(model, "quant_predicate") else None
    quantize_model(model, cfg, 64, 4, quant_predicate=(lambda p, m: pred(p, m)) if pred else None)
    mx.eval(model.parameters())
    return model


def decode_ms(model, steps: int) -> float:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    ids = mx.array([[(7 * i) % SHAPE["vocab_size"] for i in range(PROMPT)]])
    tok = mx.argmax(model(ids, cache=cache)[0, -1])
    mx.eval(tok)
    t0 = time.process_time()
    for _ in range(steps):
        tok = mx.argmax(model(tok.reshape(1, 1), cache=cache)[0, -1])
        mx.eval(tok)
    return 1e3 * (time.process_time() - t0) / steps


def compiled_ms(model, steps: int) -> float:
    """decode_ms through the compiled step (mixbits.decode.Decoder): the
    same prompt, the same greedy steps, the logits the plain step gives
    (Decoder checks its first step against the model's own forward)."""
    from mixbits.decode import Decoder

    d = Decoder(model)
    ids = mx.array([[(7 * i) % SHAPE["vocab_size"] for i in range(PROMPT)]])
    tok = mx.argmax(d.prefill(ids, capacity=PROMPT + steps + 1)[0, -1])
    mx.eval(tok)
    tok = mx.argmax(d.step(tok.reshape(1, 1))[0, -1])  # traced (and verified) here, untimed
    mx.eval(tok)
    t0 = time.process_time()
    for _ in range(steps - 1):
        tok = mx.argmax(d.step(tok.reshape(1, 1))[0, -1])
        mx.eval(tok)
    return 1e3 * (time.process_time() - t0) / (steps - 1)


def main(argv=None) -> dict:
    import mixbits
    from mixbits import _ext
    from mixbits.commands.bench import machine_info, page_policy

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--out", default=str(RESULTS / "moe_decode.json"))
    a = ap.parse_args(argv)
    mx.set_default_device(mx.cpu)
    _ext.set_max_threads(1)

    models = {"mlx": build()}
    for name, act, rp in (("mixbits-float", "float", False), ("mixbits-int8", "int8", False),
                          ("mixbits-int8-repacked", "int8", True)):
        models[name] = build()  # the same weights (same seed)
        mixbits.patch(models[name], activations=act, repack=rp)
    from mixbits.nn import MixedQuantizedSwitchLinear

    experts = [m for _, m in models["mixbits-float"].named_modules() if isinstance(m, MixedQuantizedSwitchLinear)]
    per_token = sum(sum(a.nbytes for a in m.quantized_tensor().arrays()) // m.num_experts for m in experts)
    expert_mb = per_token * SHAPE["num_experts_per_tok"] / 1e6
    runs = {k: (decode_ms, m) for k, m in models.items()}
    runs["mixbits-int8-repacked-compiled"] = (compiled_ms, models["mixbits-int8-repacked"])
    times = {k: [] for k in runs}
    for f, m in runs.values():
        f(m, 2)  # warm (and MLX's one-off build of the compiled step's fused kernels)
    for _ in range(a.reps):
        for k, (f, m) in runs.items():
            times[k].append(f(m, a.steps))
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"machine": machine_info(page_policy()), "shape": SHAPE, "prompt": PROMPT, "steps": a.steps, "reps": a.reps,
           "clock": "time.process_time, 1 thread", "expert_mb_per_token": expert_mb,
           "ms_per_token": times, "median_ms_per_token": med,
           "speedup_vs_mlx": {k: med["mlx"] / v for k, v in med.items()}}
    print(f"expert weights read per token: {expert_mb:.1f} MB (top-{SHAPE['num_experts_per_tok']})")
    for k in runs:
        print(f"{k:>22}: {med[k]:7.2f} ms/token  ({' '.join(f'{t:.2f}' for t in times[k])})  "
              f"x{med['mlx'] / med[k]:.2f} vs mlx")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
