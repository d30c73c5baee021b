"""mixbits.patch on multi-head latent attention (DeepSeek-V2, MiniCPM3...):
key heads wider than value heads, outside the attention kernel's contract
(k and v one shape). The router must leave those calls to MLX's op, per
call, and the patched model give the unpatched model's logits, prompt and
decode alike."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import tiny_models


def _count_kernel_calls(monkeypatch):
    from mixbits import _ext

    calls = {"n": 0}
    real = _ext.causal_attention

    def counted(*a):
        calls["n"] += 1
        return real(*a)

    monkeypatch.setattr(_ext, "causal_attention", counted)
    return calls


def _prompt_then_step(model, toks):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prompt = model(toks, cache=cache)
    step = model(toks[:, -1:], cache=cache)
    mx.eval(prompt, step)
    return np.array(prompt), np.array(step)


@pytest.mark.parametrize("arch", ["deepseek_v2", "minicpm3"])
def test_patched_mla_model_gives_unpatched_logits(arch, monkeypatch):
    import mixbits
    from mixbits.routing import unpatch_functions

    model, cfg = tiny_models.build(arch)
    assert cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] != cfg["v_head_dim"]
    toks = mx.array(np.random.default_rng(0).integers(0, 160, (2, 12)))
    want_prompt, want_step = _prompt_then_step(model, toks)
    calls = _count_kernel_calls(monkeypatch)
    mixbits.patch(model)
    try:
        got_prompt, got_step = _prompt_then_step(model, toks)
    finally:
        unpatch_functions(model)
    assert calls["n"] == 0  # every attention call went to MLX's op
    # RMSNorm and RoPE still run on mixbits' kernels: float32 rounding apart.
    np.testing.assert_allclose(got_prompt, want_prompt, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_step, want_step, rtol=1e-4, atol=1e-4)


def test_router_decides_per_call(monkeypatch):
    """The same routed function takes the kernel's shapes and passes the
    others on: the check is made on every call, not once per model."""
    from mlx_lm.models import llama

    from mixbits.routing import _ACTIVE, patch_functions, unpatch_functions

    model, _ = tiny_models.build("llama")
    calls = _count_kernel_calls(monkeypatch)
    patch_functions(model)
    try:
        sdpa = llama.scaled_dot_product_attention
        q = mx.random.normal((1, 4, 6, 24), key=mx.random.key(1))
        k = mx.random.normal((1, 2, 6, 24), key=mx.random.key(2))
        for v_dim in (24, 8, 24):
            v = mx.random.normal((1, 2, 6, v_dim), key=mx.random.key(3))
            want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal")
            token = _ACTIVE.set(True)
            try:
                got = sdpa(q, k, v, cache=None, scale=0.2, mask="causal")
            finally:
                _ACTIVE.reset(token)
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
        assert calls["n"] == 2  # the two equal-shape calls took the kernel
    finally:
        unpatch_functions(model)
