"""SmolLM2-135M end to end: prefill and decode tokens/s with stock MLX
quantized layers vs mixbits layers (``mixbits.patch``), in the same run.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m pytest bench/bench_model.py [--bench-full]

Prefill: one forward over a prompt of P tokens (logits for every position,
as a perplexity pass computes). Decode: one token per forward against a KV
cache already holding the prompt. Both models hold the same arrays (patch
re-uses them), so the two columns differ only in the matmul kernel.
"""

from __future__ import annotations

import pytest

import mlx.core as mx

import mixbits
from mixbits.models import Unavailable, smollm2

IMPLS = ["mlx", "mixbits"]
_MODELS: dict = {}
_RESULTS: dict = {}


def _prompt_len(full: bool) -> int:
    return 64 if full else 16


def _model(impl: str):
    if impl not in _MODELS:
        try:
            path = smollm2.fetch()
        except Unavailable as e:
            pytest.skip(f"SmolLM2 cannot be downloaded: {e}")
        from mixbits.models.gguf import load_gguf

        model, tok, _ = load_gguf(path)
        if impl == "mixbits":
            mixbits.patch(model)
        _MODELS[impl] = (model, tok)
    return _MODELS[impl]


def _prompt(tok, n: int) -> mx.array:
    text = "The quick brown fox jumps over the lazy dog while the capital of France is Paris. " * 8
    ids = tok.encode(text)[:n]
    assert len(ids) == n
    return mx.array([ids])


def _format(rows, meta):
    lines = [f"SmolLM2-135M Q4_1/Q8_0, prompt {meta['prompt']} tokens, decode {meta['decode']} steps (batch 1)",
             f"{'phase':<8} {'mlx tok/s':>10} {'mixbits tok/s':>14} {'mixbits/mlx':>12}"]
    for phase in ("prefill", "decode"):
        r = {row["impl"]: row["tps"] for row in rows if row["phase"] == phase}
        if "mlx" in r and "mixbits" in r:
            lines.append(f"{phase:<8} {r['mlx']:>10.1f} {r['mixbits']:>14.1f} {r['mixbits'] / r['mlx']:>11.2f}x")
    return "\n".join(lines)


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill(benchmark, impl, bench_full, bench_table):
    model, tok = _model(impl)
    p = _prompt_len(bench_full)
    x = _prompt(tok, p)

    def run():
        mx.eval(model(x))

    benchmark.group = "smollm2-prefill"
    benchmark.extra_info.update({"impl": impl, "tokens": p})
    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    tps = p / benchmark.stats.stats.min
    table = bench_table("model", _format)
    table.meta.update({"prompt": p, "decode": 8})
    table.add({"phase": "prefill", "impl": impl, "tokens": p, "tps": tps})


@pytest.mark.parametrize("impl", IMPLS)
def test_decode(benchmark, impl, bench_full, bench_table):
    from mlx_lm.models.cache import make_prompt_cache

    model, tok = _model(impl)
    p = _prompt_len(bench_full)
    x = _prompt(tok, p)
    steps = 8
    state = {}

    def setup():
        cache = make_prompt_cache(model)
        logits = model(x, cache=cache)
        mx.eval(logits, [c.state for c in cache])
        state["cache"], state["next"] = cache, mx.argmax(logits[:, -1:], axis=-1)
        return (), {}

    def run():
        cache, nxt = state["cache"], state["next"]
        for _ in range(steps):
            logits = model(nxt, cache=cache)
            nxt = mx.argmax(logits[:, -1:], axis=-1)
            mx.eval(nxt)

    benchmark.group = "smollm2-decode"
    benchmark.extra_info.update({"impl": impl, "steps": steps, "prompt": p})
    benchmark.pedantic(run, setup=setup, rounds=3, iterations=1, warmup_rounds=1)
    tps = steps / benchmark.stats.stats.min
    table = bench_table("model", _format)
    table.meta.update({"prompt": p, "decode": steps})
    table.add({"phase": "decode", "impl": impl, "steps": steps, "tps": tps})
