"""Model-level evaluation: greedy decoding and perplexity.

Both take any MLX language model called as ``model(ids[None], cache=...)``
returning logits [1, L, vocab] (mlx-lm's convention).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import mlx.core as mx


def _make_cache(model):
    try:
        from mlx_lm.models.cache import make_prompt_cache
    except ImportError:  # pragma: no cover - mlx-lm is a dependency of the model path
        return None
    return make_prompt_cache(model)


@dataclass
class Generation:
    """Tokens produced by :func:`greedy_generate`, with prefill/decode timings."""

    prompt_ids: list
    ids: list = field(default_factory=list)
    text: str = ""
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return len(self.prompt_ids) / self.prefill_s if self.prefill_s else float("nan")

    @property
    def decode_tps(self) -> float:
        # The first token comes out of the prefill; each later one costs a decode step.
        steps = max(len(self.ids) - 1, 0)
        return steps / self.decode_s if self.decode_s else float("nan")


def greedy_generate(model, tokenizer, prompt: str, max_tokens: int = 16, stop_at_eos: bool = True) -> Generation:
    """Greedy (argmax) decoding of up to ``max_tokens`` tokens after ``prompt``."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("prompt encodes to no tokens")
    eos = set(getattr(tokenizer, "eos_token_ids", []) or [])
    gen = Generation(prompt_ids=list(ids))
    cache = _make_cache(model)
    t0 = time.perf_counter()
    logits = model(mx.array([ids]), cache=cache)
    nxt = mx.argmax(logits[0, -1]).item()
    gen.prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    while True:
        if stop_at_eos and nxt in eos:
            break
        gen.ids.append(nxt)
        if len(gen.ids) >= max_tokens:
            break
        if cache is None:
            logits = model(mx.array([ids + gen.ids]))
        else:
            logits = model(mx.array([[nxt]]), cache=cache)
        nxt = mx.argmax(logits[0, -1]).item()
    gen.decode_s = time.perf_counter() - t0
    gen.text = tokenizer.decode(gen.ids)
    return gen


def token_nll(model, ids, context: int = 512) -> tuple[float, int]:
    """Sum of next-token negative log-likelihoods (nats) and the count, over
    non-overlapping windows of ``context`` tokens (each window scored from
    its second token on, so no prediction sees past its window)."""
    if context < 2:
        raise ValueError(f"context must be >= 2, got {context}")
    ids = list(ids)
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, context):
        window = ids[start : start + context]
        if len(window) < 2:
            break
        x = mx.array([window])
        logits = model(x).astype(mx.float32)[0, :-1]
        targets = mx.array(window[1:])
        lse = mx.logsumexp(logits, axis=-1)
        picked = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
        total += (lse - picked).sum().item()
        count += len(window) - 1
    return total, count


def perplexity(model, ids, context: int = 512) -> float:
    """exp(mean next-token NLL) of ``ids`` under ``model``."""
    total, count = token_nll(model, ids, context)
    if count == 0:
        raise ValueError("need at least 2 tokens for perplexity")
    return math.exp(total / count)
