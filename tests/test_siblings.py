"""Sibling projections fused into one node (python/mixbits/siblings.py,
RepackedQMatmulGroup): learned from the model's own calls, bit for bit the
unfused outputs, and every other call computed alone."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mixbits
from mixbits import _ext, ops
from mixbits.siblings import SiblingGroup, remove_sibling_groups

from int_contract import rand_qt
from tiny_model import tiny_llama, tiny_tokens


def patched_llama(act="int8"):
    model = tiny_llama(seed=0)
    nn.quantize(model, group_size=32, bits=4)
    mixbits.patch(model, activations=act, repack=True)
    return model


@pytest.fixture
def group_calls(monkeypatch):
    calls = []
    real = _ext.repacked_qmatmul_group

    def counting(x, members, *a):
        calls.append(len(members))
        return real(x, members, *a)

    monkeypatch.setattr(_ext, "repacked_qmatmul_group", counting)
    return calls


@pytest.mark.parametrize("act", ["int8", "int16"])
def test_learned_groups_give_the_unfused_outputs(act, group_calls):
    fused, alone = patched_llama(act), patched_llama(act)
    remove_sibling_groups(alone)
    tokens = mx.array(tiny_tokens(1, 7))
    for step in range(4):
        a, b = fused(tokens), alone(tokens)
        np.testing.assert_array_equal(np.array(a), np.array(b))
    attn = fused.model.layers[0].self_attn
    mlp = fused.model.layers[0].mlp
    assert attn.q_proj.sibling_group.fused == (0, 1, 2)  # q, k, v; o_proj (same input size) is not
    assert [attn.q_proj.sibling_group.layers[i] for i in (0, 1, 2)] == [attn.q_proj, attn.k_proj, attn.v_proj]
    assert mlp.gate_proj.sibling_group.fused is not None and len(mlp.gate_proj.sibling_group.fused) == 2
    # learned over the first two forwards, fused in the last two: 2 layers x (qkv + gate/up)
    assert group_calls == [3, 2, 3, 2] * 2 and sorted(set(group_calls)) == [2, 3]


def test_a_member_called_on_another_input_computes_alone(group_calls):
    model = patched_llama()
    tokens = mx.array(tiny_tokens(1, 5))
    for _ in range(3):
        model(tokens)
    attn = model.model.layers[0].self_attn
    x = mx.random.normal((1, 5, 64))
    other = mx.random.normal((1, 5, 64))
    group = attn.q_proj.sibling_group
    q = attn.q_proj(x)  # computes q, k, v on x
    k_other = attn.k_proj(other)  # not x: alone, not the pending k(x)
    v = attn.v_proj(x)  # pending v(x)
    for layer, inp, got in ((attn.q_proj, x, q), (attn.k_proj, other, k_other), (attn.v_proj, x, v)):
        want = ops.qmatmul(inp, layer.matmul_tensor(), activations="int8") + layer.bias \
            if "bias" in layer else ops.qmatmul(inp, layer.matmul_tensor(), activations="int8")
        np.testing.assert_array_equal(np.array(got), np.array(want))
    # an unrepacked member stops the fusion (its weight is not a repacked one)
    attn.k_proj.unrepack()
    n = len(group_calls)
    assert attn.q_proj(x).shape == (1, 5, 64) and len(group_calls) == n
    assert group.fused == (0, 1, 2)


def test_learning_needs_the_same_bunch_twice():
    qts = [rand_qt(np.random.default_rng(i), 32, [(4, 32, 64)]) for i in range(3)]
    layers = [mixbits.nn.MixedQuantizedLinear.from_tensor(qt) for qt in qts]
    for m in layers:
        m.activations = "int8"
        m.repack()
    g = SiblingGroup(layers)
    x, y = mx.ones((1, 64)), mx.zeros((1, 64))
    for m in layers[:2]:
        assert g(m, x) is None
    assert g(layers[0], y) is None and g.fused is None  # one bunch seen: (0, 1)
    assert g(layers[1], y) is None
    assert g(layers[2], x) is None and g.fused == (0, 1)  # (0, 1) twice
    with pytest.raises(ValueError, match="not a member"):
        g(mixbits.nn.MixedQuantizedLinear.from_tensor(qts[0]), x)


def test_compiled_decode_with_groups_matches_the_plain_forward():
    from mlx_lm.models.cache import make_prompt_cache

    from mixbits.decode import Decoder

    model = patched_llama("int8")
    prompt = tiny_tokens(1, 9)[0].tolist()
    cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    d = Decoder(model)
    d.prefill(prompt, capacity=20)
    for t in (3, 17, 42):
        c = d.step(t)
        p = model(mx.array([[t]]), cache=cache)
        np.testing.assert_array_equal(np.array(c), np.array(p))
    assert model.model.layers[1].mlp.up_proj.sibling_group.fused is not None
