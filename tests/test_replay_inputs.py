"""Replayer.input_hessian records a block's linears in one replay of the
block (``along``): each X^T X is bit-identical to the product of the
inputs captured in the model's own forward, summed per call in float32
as one linear's recording alone does, and close to numpy's float64
X^T X of the same inputs; linears given one input (q/k/v, gate/up) share
it, a site of another block replaces what is kept, and quantize records
each block's inputs once, with a Replayer that computes no logits
(``logits=False``: the same recorded calls, checked on one block)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import tiny_models
from mixbits.adapter import ModelAdapter
from mixbits.measure.candidates import build_layer, parse_candidate, records_input
from mixbits.measure.replay import BlockProxy, Replayer


class _Capture(nn.Module):
    """Keeps every input of the module it wraps (float32 numpy [rows, K])."""

    def __init__(self, inner, store):
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "store", store)

    def __call__(self, x, *args, **kwargs):
        self.store.append(np.array(x.astype(mx.float32)).reshape(-1, x.shape[-1]))
        return self.inner(x, *args, **kwargs)


def _captured(model, ad, chunks, paths):
    """{path: [inputs per call]} from the model's own forward on each chunk."""
    stores = {p: [] for p in paths}
    originals = {p: ad.get(p) for p in paths}
    try:
        for p in paths:
            ad.set(p, _Capture(originals[p], stores[p]))
        for c in chunks:
            mx.eval(model(c))
    finally:
        for p in paths:
            ad.set(p, originals[p])
    return stores


def _float32_sum(xs):
    """X^T X as one linear's recording makes it: each call's float32
    product, added in call order."""
    h = None
    for x in xs:
        hx = x.T @ x
        h = hx if h is None else h + hx
    return h


@pytest.fixture(scope="module")
def setup():
    model, _ = tiny_models.build("llama")  # hidden 64 = 4 heads x 16: q's and o's inputs alike in shape
    ad = ModelAdapter(model)
    toks = np.random.default_rng(3).integers(0, 160, (4, 12))
    chunks = [mx.array(toks[:2]), mx.array(toks[2:])]
    sites = [s for s in ad.sites if records_input(s)]
    caps = _captured(model, ad, chunks, [s.path for s in sites])
    return model, ad, chunks, sites, caps


def _check(site, got, caps):
    h, n = got
    xs = caps[site.path]
    assert n == sum(len(x) for x in xs)
    np.testing.assert_array_equal(h, _float32_sum(xs), err_msg=site.path)
    x64 = np.concatenate(xs).astype(np.float64)
    np.testing.assert_allclose(h, x64.T @ x64, rtol=1e-5, atol=1e-5 * np.abs(x64).max() ** 2,
                               err_msg=site.path)


@pytest.mark.parametrize("replay", [True, False], ids=["block-replay", "whole-model"])
def test_one_pass_per_block_gives_each_linears_own_product(setup, monkeypatch, replay):
    model, ad, chunks, sites, caps = setup
    rp = Replayer(model, chunks, ad)
    assert rp.replayable
    rp.replayable = replay  # False: the path of a model whose blocks cannot be replayed
    passes = []
    record = rp._record_inputs
    monkeypatch.setattr(rp, "_record_inputs", lambda group: passes.append([s.path for s in group])
                        or record(group))
    blocks = sorted({s.block for s in sites})
    assert len(blocks) == 4 and all(sum(s.block == b for s in sites) == 7 for b in blocks)
    got = {}
    for s in sites:  # in the adapter's order: q, k, v, o, gate, up, down per block
        got[s.path] = rp.input_hessian(s, along=sites)
        # what is kept is one block's: the last pass's
        assert {ad.site(p).block for p in rp._inputs} == {s.block}
    assert [len(p) for p in passes] == [7] * 4  # one pass per block, all its linears
    for s in sites:
        _check(s, got[s.path], caps)
    # alone (today's one-site pass) gives the same bits
    for s in sites[:7] + sites[-7:]:
        h, n = rp.input_hessian(s)
        assert n == got[s.path][1]
        np.testing.assert_array_equal(h, got[s.path][0])
    # shared inputs share one matrix, which is read-only; distinct inputs do not
    b0 = {ad.local_path(s): got[s.path][0] for s in sites if s.block == 0}
    assert b0["self_attn.q_proj"] is b0["self_attn.k_proj"] is b0["self_attn.v_proj"]
    assert b0["mlp.gate_proj"] is b0["mlp.up_proj"]
    assert b0["self_attn.o_proj"] is not b0["self_attn.q_proj"]
    assert not np.array_equal(b0["self_attn.o_proj"], b0["self_attn.q_proj"])
    with pytest.raises(ValueError, match="read-only"):
        b0["self_attn.q_proj"][0, 0] = 1.0


def test_out_of_order_asks_and_sites_of_other_blocks(setup):
    """A site asked for out of the block order, and ``along`` naming other
    blocks' sites: each still gets its own matrix; the kept matrices are
    those of the asked site's block only."""
    model, ad, chunks, sites, caps = setup
    rp = Replayer(model, chunks, ad)
    rng = np.random.default_rng(0)
    for i in rng.permutation(len(sites)):
        s = sites[i]
        _check(s, rp.input_hessian(s, along=sites[::-1]), caps)
        assert {ad.site(p).block for p in rp._inputs} == {s.block}
    rp.forget_inputs()
    assert rp._inputs == {}


@pytest.mark.parametrize("replay", [True, False], ids=["block-replay", "whole-model"])
def test_inputs_only_replayer_records_the_same_calls_and_matrices(setup, monkeypatch, replay):
    """Replayer(logits=False), what quantize and the joint evaluator use:
    no reference logits, the replay checked on one block instead of to the
    logits, the same recorded block calls bit for bit, and every X^T X
    the product of the inputs the model's own forward gave its linears."""
    model, ad, chunks, sites, caps = setup
    full = Replayer(model, chunks, ad)

    def no_logits_check(self):
        raise AssertionError("the check to the logits ran")

    monkeypatch.setattr(Replayer, "_check_replay", no_logits_check)
    rp = Replayer(model, chunks, ad, logits=False)
    assert rp.replayable and rp.logits == [] and len(rp.records) == len(chunks)
    for got, want in zip(rp.records, full.records):
        assert len(got) == len(want) == 4
        for (_, _, a), (_, _, b) in zip(got, want):
            assert mx.array_equal(a, b).item()
    with pytest.raises(ValueError, match="logits=False"):
        rp.candidate_logits(0, sites[0], [ad.get(sites[0].path)])
    rp.replayable = replay
    for s in sites:
        _check(s, rp.input_hessian(s, along=sites), caps)


class _Drifting(BlockProxy):
    """A block whose output moves with every call (state a replay cannot
    reproduce from the recorded arguments)."""

    def __init__(self, inner):
        super().__init__(inner)
        object.__setattr__(self, "calls", 0)

    def __call__(self, x, *args, **kwargs):
        object.__setattr__(self, "calls", self.calls + 1)
        return self._inner(x, *args, **kwargs) + 0.5 * self.calls


def test_inputs_only_replayer_falls_back_when_a_block_does_not_replay():
    """The one-block check: a block that does not give its recorded output
    back means full forwards for the layer inputs, with the warning."""
    model, _ = tiny_models.build("llama")
    ad = ModelAdapter(model)
    toks = mx.array(np.random.default_rng(5).integers(0, 160, (2, 8)))
    blocks = ad.blocks
    blocks[len(blocks) // 2] = _Drifting(blocks[len(blocks) // 2])
    with pytest.warns(RuntimeWarning, match="recorded output back; recording layer inputs with full"):
        rp = Replayer(model, [toks], ad, logits=False)
    assert not rp.replayable and rp.records == []
    h, n = rp.input_hessian(next(s for s in ad.sites if s.block == 0 and records_input(s)))
    assert n == 16 and h.shape == (64, 64)


def test_quantize_records_each_block_once_and_builds_from_its_own_inputs(setup, monkeypatch):
    """quantize_candidates at +search kinds: one pass per block, and every
    layer bit-identical to build_layer with X^T X of its captured inputs."""
    from mixbits.commands.quantize import quantize_candidates

    _, _, chunks, sites, _ = setup
    model, _ = tiny_models.build("llama")  # a fresh copy of the same weights to quantize
    ad = ModelAdapter(model)
    tokens = np.concatenate([np.array(c) for c in chunks])
    assert tokens.shape[0] == 4  # quantize's chunks are 4 rows: one forward here
    caps = _captured(model, ad, [mx.array(tokens)], [s.path for s in sites])
    kinds = ["4b_g64+search", "3b_g32+search", "4b10_3b_g64+search"]
    # the allocation in reverse path order: quantize groups it by block
    chosen = {s.path: parse_candidate(kinds[i % 3]) for i, s in reversed(list(enumerate(sites)))}
    originals = {p: ad.get(p) for p in chosen}
    passes = []
    record = Replayer._record_inputs

    def counted(self, group):
        passes.append(len(group))
        return record(self, group)

    monkeypatch.setattr(Replayer, "_record_inputs", counted)
    made = []
    init = Replayer.__init__
    monkeypatch.setattr(Replayer, "__init__", lambda self, *a, **k: made.append(self) or init(self, *a, **k))
    replaced = quantize_candidates(model, chosen, tokens=tokens)
    assert sorted(replaced) == sorted(chosen)
    assert passes == [7] * 4
    # the layer inputs only: no reference logits computed
    assert len(made) == 1 and not made[0].with_logits and made[0].logits == []
    for p, c in chosen.items():
        want = build_layer(originals[p], c, None, (_float32_sum(caps[p]), sum(map(len, caps[p]))))
        got, want = tree_flatten(ad.get(p).parameters()), tree_flatten(want.parameters())
        assert [k for k, _ in got] == [k for k, _ in want]
        for (k, a), (_, b) in zip(got, want):
            np.testing.assert_array_equal(np.array(a), np.array(b), err_msg=f"{p} {k}")


def _quantized_llama():
    """A tiny llama with MLX's 4-bit QuantizedLinear layers, as a GGUF or an
    mlx-community folder loads: the blocks run MLX's CPU quantized matmul."""
    model, _ = tiny_models.build("llama")
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear))
    mx.eval(model.parameters())
    return model


def test_quantize_with_the_measured_model_builds_the_joint_evaluators_layers(monkeypatch):
    """quantize_candidates(measured=...): the layer inputs come from the
    model as the sweep runs it (mixbits' kernels): each X^T X is the joint
    evaluator's bit for bit, and every calibrated layer the one it built
    and scored on that model; the model as loaded (MLX's quantized matmul)
    gives its linears other last bits."""
    from mixbits import patch
    from mixbits.commands.quantize import quantize_candidates
    from mixbits.measure import candidates
    from mixbits.measure.joint import JointEvaluator

    tokens = np.random.default_rng(4).integers(0, 160, (4, 12))
    twin = _quantized_llama()
    patch(twin)
    ad_twin = ModelAdapter(twin)
    assert type(ad_twin.get("model.layers.0.self_attn.q_proj")).__name__ == "MixedQuantizedLinear"
    sites = [s for s in ad_twin.sites if records_input(s)]
    kinds = ["4b_g64+search", "3b_g32+search", "4b10_3b_g64+search"]
    chosen = {s.path: parse_candidate(kinds[i % 3]) for i, s in enumerate(sites)}
    ev = JointEvaluator(twin, tokens, chunk=4)
    want = {p: tree_flatten(ev.layer(p, c.name).parameters()) for p, c in chosen.items()}
    want_h = {p: ev.hessian(p)[0] for p in chosen}

    model = _quantized_llama()
    ad = ModelAdapter(model)
    assert type(ad.get(sites[0].path)) is nn.QuantizedLinear
    path_of = {id(ad.get(p)): p for p in chosen}
    given = {}
    build = candidates.build_layer

    def recording(module, cand, scale_dtype=None, inputs=None, **kw):
        given[path_of[id(module)]] = inputs
        return build(module, cand, scale_dtype, inputs, **kw)

    monkeypatch.setattr(candidates, "build_layer", recording)
    quantize_candidates(model, chosen, tokens=tokens, measured=twin)
    assert sorted(given) == sorted(chosen)
    for p in chosen:
        np.testing.assert_array_equal(given[p][0], want_h[p], err_msg=p)
        got = tree_flatten(ad.get(p).parameters())
        assert [k for k, _ in got] == [k for k, _ in want[p]]
        for (k, a), (_, b) in zip(got, want[p]):
            np.testing.assert_array_equal(np.array(a), np.array(b), err_msg=f"{p} {k}")
    # the model as loaded: its own forward's inputs differ in their last bits
    own = Replayer(_quantized_llama(), [mx.array(tokens)], logits=False)
    assert any(not np.array_equal(own.input_hessian(s)[0], want_h[s.path]) for s in sites)
    other, _ = tiny_models.build("qwen3")
    with pytest.raises(ValueError, match="same quantizable tensors"):
        quantize_candidates(_quantized_llama(), chosen, tokens=tokens, measured=other)
