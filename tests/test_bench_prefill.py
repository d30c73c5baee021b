"""bench/bench_decode.py's prefill timing does the work llama-bench's pp64
does: every prompt token through the layers into the cache, and the head
(the vocabulary-sized matmul) on the last token only, as mlx_lm.generate
runs a prompt. The ``all_logits`` variant runs the head on every token.
Checked on a tiny random llama by recording what the head is handed and
whether its output is still held when the next call comes (an array no
one holds is never evaluated: MLX is lazy)."""

import sys
import weakref
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

import tiny_models

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_decode  # noqa: E402


def _recording_head(model, calls: list):
    """Each head call appends [rows, weakref to its output]."""
    head = model.lm_head
    base = type(head)

    class Recording(base):
        def __call__(self, x):
            y = base.__call__(self, x)
            calls.append([x.shape[-2], weakref.ref(y)])
            return y

    head.__class__ = Recording


@pytest.mark.parametrize("all_logits", [False, True])
def test_prefill_runs_the_head_as_llama_bench_does(all_logits):
    mx.set_default_device(mx.cpu)
    model, cfg = tiny_models.build("llama")
    nn.quantize(model, group_size=32, bits=4)
    calls = []
    _recording_head(model, calls)
    ids = list(range(3, 15))
    cpu, wall = bench_decode.prefill_tps(model, ids, reps=2, all_logits=all_logits)
    assert cpu > 0 and wall > 0
    # reps + 1 prefills (one untimed). Every output is dropped by now.
    assert all(ref() is None for _, ref in calls)
    if all_logits:
        assert [n for n, _ in calls] == [12] * 3
    else:
        # The prompt but its last token (its logits built lazily and
        # dropped unevaluated: the cache is all that is evaluated), then
        # the last token's logits.
        assert [n for n, _ in calls] == [11, 1] * 3


def test_prompt_logits_are_dropped_before_anything_is_evaluated(monkeypatch):
    """The 11-row logits are no longer held when the cache is evaluated,
    so MLX never computes them."""
    mx.set_default_device(mx.cpu)
    model, cfg = tiny_models.build("llama")
    calls, seen = [], []
    _recording_head(model, calls)
    real_eval = mx.eval

    def eval_checking(*a):
        seen.append([ref() is None for n, ref in calls if n > 1])
        return real_eval(*a)

    monkeypatch.setattr(bench_decode.mx, "eval", eval_checking)
    bench_decode.prefill_tps(model, list(range(3, 15)), reps=1)
    assert seen and all(all(s) for s in seen)


def test_prefill_fills_the_cache_with_the_whole_prompt():
    """The generate-way prefill leaves the same cache as one model(ids) call:
    the next token's logits match."""
    from mlx_lm.models.cache import make_prompt_cache

    mx.set_default_device(mx.cpu)
    model, cfg = tiny_models.build("llama")
    ids = list(range(3, 15))
    ref_cache = make_prompt_cache(model)
    model(mx.array([ids]), cache=ref_cache)
    caches = []
    real = bench_decode.make_prompt_cache if hasattr(bench_decode, "make_prompt_cache") else None
    assert real is None  # the helper makes its own cache through mlx_lm
    import mlx_lm.models.cache as cache_mod

    orig = cache_mod.make_prompt_cache

    def keep(m, *a, **k):
        c = orig(m, *a, **k)
        caches.append(c)
        return c

    cache_mod.make_prompt_cache = keep
    try:
        bench_decode.prefill_tps(model, ids, reps=1)
    finally:
        cache_mod.make_prompt_cache = orig
    assert caches and all(c[0].offset == len(ids) for c in caches)
    nxt = mx.array([[7]])
    want = model(nxt, cache=ref_cache)
    got = model(nxt, cache=caches[-1])
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item()


@pytest.mark.parametrize("context", ["0", "9000"])
def test_context_outside_the_model_is_refused_before_anything_runs(context, capsys):
    """--context beyond SmolLM2's 8192 positions (less the steps), or empty:
    one clear error, before a model loads or llama-bench runs."""
    with pytest.raises(SystemExit, match="--context must be in"):
        bench_decode.main(["--context", context, "--llama-bench", "/nonexistent/llama-bench"])


def test_long_prompts_repeat_the_text():
    """prompt_ids gives exactly n tokens for any n, the 64-token prompt as before."""
    from decode_profile import TEXT, prompt_ids

    class Tok:  # one token per character
        def encode(self, text):
            return [ord(c) for c in text]

    tok = Tok()
    assert prompt_ids(tok, 64) == [ord(c) for c in TEXT[:64]]
    long = prompt_ids(tok, 3 * len(TEXT) + 5)
    assert len(long) == 3 * len(TEXT) + 5 and long == [ord(c) for c in (TEXT * 4)[:len(long)]]
