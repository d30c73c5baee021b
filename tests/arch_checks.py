"""The checks every architecture goes through, shared by
tests/test_architectures.py (CI) and bench/all_architectures.py (all of
them, timed). Models come from tests/arch_configs.py's data; the KL and
pipeline checks are test_any_model's, run on any model."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np

import arch_configs
from test_any_model import direct_kl, _one_per_kind, pipeline

SEQ = 16
# 2-bit codes are the largest damage: a KL no rounding hides. The 4-bit
# candidate at group 32 covers widths 64 does not divide.
KL_CANDS = ["2b_g32", "4b_g32"]


def tokens(n: int = 2, seq: int = SEQ):
    return arch_configs.tokens(n, seq)


def reference(model) -> tuple[object, bool]:
    """(Replayer, replayable): the sweep's reference logits must be
    model(tokens) whether or not the model replays from a prefix."""
    from mixbits.measure.replay import Replayer

    toks = tokens()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rp = Replayer(model, [mx.array(toks)])
    want = np.array(model(mx.array(toks)).astype(mx.float32))
    np.testing.assert_array_equal(np.array(rp.logits[0]), want)
    if not rp.replayable:
        assert any("full forward" in str(w.message) for w in caught), "fallback without its warning"
    return rp, rp.replayable


def kl_roles(model, rp, roles: int | None = None) -> list[tuple[str, str, float, float]]:
    """For one tensor of each role (block child and form, each tensor
    outside the blocks): (path, candidate, sweep KL, KL of the candidate
    put in the real model). ``roles``: only the first that many."""
    from mixbits.measure.candidates import parse_candidate, supports
    from mixbits.measure.sweep import SweepConfig, measure_site

    adapter = rp.adapter
    cands = [parse_candidate(c) for c in KL_CANDS]
    toks = tokens()
    ref = model(mx.array(toks))
    out = []
    for site in _one_per_kind(adapter, cands)[:roles]:
        c = next(c for c in cands if supports(c, site))
        res = measure_site(rp, site, [c], SweepConfig([c.name], max_batch=8))
        out.append((site.path, c.name, res.kl[c.name], direct_kl(model, adapter, site, c, toks, ref)))
    return out


def patched_logits(model) -> tuple[tuple, tuple]:
    """(unpatched, patched) logits of a prompt and one decode step with a
    KV cache: mixbits.patch must not change what the model computes."""
    import mixbits
    from mixbits.routing import unpatch_functions
    from mlx_lm.models.cache import make_prompt_cache

    toks = mx.array(tokens(seq=12))

    def run():
        cache = make_prompt_cache(model)
        prompt = model(toks, cache=cache)
        step = model(toks[:, -1:], cache=cache)
        mx.eval(prompt, step)
        return np.array(prompt.astype(mx.float32)), np.array(step.astype(mx.float32))

    want = run()
    mixbits.patch(model)
    try:
        got = run()
    finally:
        unpatch_functions(model)
    return want, got


__all__ = ["pipeline", "reference", "kl_roles", "patched_logits", "tokens"]
