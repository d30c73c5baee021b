"""The gradient proxy's Fisher diagonal, formed from tapped output
gradients (dy^T x per sequence), against MLX differentiating the dense
weights directly with the same sampled targets: equal to float tolerance
on many architectures, tied embeddings, expert and multi-head stacks, a
mixbits-quantized model and batches of several sequences."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mixbits
import tiny_models
from mixbits.adapter import ModelAdapter
from mixbits.measure.dynamic_quant import float_copy
from mixbits.measure.grad import fisher_diagonal
from mixbits.measure.taps import Taps


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _flat(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def direct_fisher(model, toks, sites, *, samples, seed, batch):
    """Independent reference: MLX's gradient w.r.t. each dense weight of a
    float copy, one sequence at a time (stacks: the whole batch, as the
    proxy takes them), with targets drawn exactly as fisher_diagonal does."""
    twin = float_copy(model)
    ad = ModelAdapter(twin)
    paths = [s.path for s in sites]
    stacks = {s.path for s in sites if s.form == "stack"}
    twin.freeze()
    for p in paths:
        ad.get(p).unfreeze(keys=["weight"], recurse=False)

    def loss(x, y):
        logits = twin(x).astype(mx.float32)
        return (mx.logsumexp(logits, -1) - mx.take_along_axis(logits, y[..., None], -1)[..., 0]).sum()

    grad_fn = nn.value_and_grad(twin, loss)
    out = {p: np.zeros(s.shape, np.float64) for p, s in zip(paths, sites)}
    key = mx.random.key(seed)
    for b0 in range(0, len(toks), batch):
        x = mx.array(toks[b0 : b0 + batch])
        ref = twin(x).astype(mx.float32)
        for _ in range(samples):
            key, sub = mx.random.split(key)
            y = mx.random.categorical(ref, key=sub)
            _, whole = grad_fn(x, y)
            whole = dict(_flat(whole))
            for p in stacks:
                g = np.array(whole[p + ".weight"], np.float64)
                out[p] += g * g
            for b in range(x.shape[0]):
                _, g1 = grad_fn(x[b : b + 1], y[b : b + 1])
                g1 = dict(_flat(g1))
                for p in paths:
                    if p not in stacks:
                        g = np.array(g1[p + ".weight"], np.float64)
                        out[p] += g * g
    return out


def _compare(model, toks, *, samples=2, batch=2):
    sites = ModelAdapter(model).sites
    got, n = fisher_diagonal(model, toks, sites, samples=samples, seed=3, batch=batch,
                             progress=False)
    want = direct_fisher(model, toks, sites, samples=samples, seed=3, batch=batch)
    assert n == toks.size * samples
    forms = set()
    for s in sites:
        g, w = np.array(got[s.path], np.float64), want[s.path]
        assert g.shape == w.shape == tuple(s.shape)
        assert w.sum() > 0, s.path
        np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-5 * np.abs(w).max(), err_msg=s.path)
        forms.add(s.form)
    return forms


@pytest.mark.parametrize("arch", ["llama_tied", "qwen3_moe", "qwen3_5", "gemma3", "deepseek_v3"])
def test_taps_equal_direct_weight_gradients(arch):
    model, _ = tiny_models.build(arch)
    toks = np.random.default_rng(0).integers(0, 160, (3, 10))
    forms = _compare(model, toks)
    assert "linear" in forms and "embedding" in forms
    if arch in ("qwen3_moe", "deepseek_v3"):
        assert "stack" in forms


def test_taps_on_a_mixbits_model_with_routed_kernels():
    """Quantized mixbits layers (differentiated through their own vjp) and
    patched attention/SwiGLU (differentiated through their own vjps)."""
    model, _ = tiny_models.build("llama_tied")
    ad = ModelAdapter(model)
    mixbits.quantize_model(model, {s.path: 4 for s in ad.sites})
    mixbits.patch(model)
    toks = np.random.default_rng(1).integers(0, 160, (2, 12))
    _compare(model, toks, samples=1, batch=2)


def test_taps_restore_the_model():
    model, _ = tiny_models.build("qwen3_moe")
    classes = {p: type(m) for p, m in model.named_modules()}
    weights = {p: m.get("weight") for p, m in model.named_modules()}
    x = mx.array(np.random.default_rng(0).integers(0, 160, (1, 8)))
    before = model(x)
    fisher_diagonal(model, np.array(x), ModelAdapter(model).sites, progress=False)
    assert {p: type(m) for p, m in model.named_modules()} == classes
    assert all(m.get("weight") is weights[p] for p, m in model.named_modules())
    assert mx.array_equal(model(x), before)


def test_taps_refuse_nesting_and_changed_calls():
    model, _ = tiny_models.build("llama")
    mods = {s.path: ModelAdapter(model).get(s.path) for s in ModelAdapter(model).sites}
    x = mx.array([[1, 2, 3]])
    with Taps(mods) as t:
        with pytest.raises(RuntimeError, match="nested"):
            Taps(mods).__enter__()
        t.perturb({})
        with pytest.raises(RuntimeError, match="not in the recorded one"):
            model(x)
