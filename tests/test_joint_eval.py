"""The joint evaluation (refine's and convert's score of an allocation)
against an independent reference -- the model's own forward with every
assigned weight replaced by mx.dequantize of the layer built for it, KL in
float64 numpy -- and its shortcuts: an assignment scored before is not run
again, and blocks before the first changed one are stubbed by stored
outputs (mixbits.measure.prefix); both must give the same numbers as a
plain evaluation."""

import copy

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mixbits.measure.joint import JointEvaluator
from tiny_models import CONFIGS, build

CANDS = ["2b_g64", "3b_g64", "4b_g64", "8b_g64", "4b_g32"]


@pytest.fixture(scope="module")
def llama():
    model, _ = build("llama", seed=3)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 160, size=(3, 24))
    return model, tokens


def plans(sites, n=6, seed=1):
    """A start and swap-like variations of it: one or two tensors changed,
    in early, middle and late blocks and outside the blocks."""
    rng = np.random.default_rng(seed)
    paths = [s.path for s in sites]
    base = {p: CANDS[int(rng.integers(0, 4))] for p in paths}
    out = [base]
    for _ in range(n):
        plan = dict(base)
        for p in rng.choice(paths, size=int(rng.integers(1, 3)), replace=False):
            plan[str(p)] = CANDS[(CANDS.index(plan[str(p)]) + 1) % len(CANDS)]
        out.append(plan)
    return out


def _log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def reference_kls(model, tokens, ev, plan):
    """Per-token KL(P_float || Q_plan) from the model's own forward, each
    assigned weight set to mx.dequantize of the evaluator's built layer."""
    ref = np.array(model(mx.array(tokens)).astype(mx.float32), dtype=np.float64)
    q = copy.deepcopy(model)
    mods = dict(q.named_modules())
    for path, cand in plan.items():
        layer = ev.layer(path, cand)
        (w, s, b), = layer._triplets()  # one segment: the uniform kinds used here
        bits, gs, _ = layer._layout.specs[0]
        # float32 scales: the exact weights (float16 ones would round them)
        dense = mx.dequantize(w, scales=s.astype(mx.float32), biases=b.astype(mx.float32),
                              group_size=gs, bits=bits)
        target = mods[path]
        assert isinstance(target, (nn.Linear, nn.Embedding)), type(target)
        target.weight = dense.astype(target.weight.dtype)
    out = np.array(q(mx.array(tokens)).astype(mx.float32), dtype=np.float64)
    p, lq = _log_softmax(ref), _log_softmax(out)
    return (np.exp(p) * (p - lq)).sum(axis=-1)


def test_joint_kl_matches_the_models_own_forward_on_dequantized_weights(llama):
    model, tokens = llama
    ev = JointEvaluator(model, tokens, chunk=2)
    assert ev._prefixes is not None, ev.reuse_reason  # the reusing path is the one checked
    for plan in plans(list(ev.sites.values()), n=3):
        got = ev.token_kls(plan)
        want = reference_kls(model, tokens, ev, plan)
        assert got.shape == want.shape == tokens.shape
        assert np.all(want > 0)
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-6)
    assert ev.blocks_skipped > 0


def test_reusing_blocks_gives_the_plain_evaluations_numbers(llama):
    model, tokens = llama
    plain = JointEvaluator(model, tokens, chunk=2, reuse_blocks=False)
    reuse = JointEvaluator(model, tokens, chunk=2)
    assert plain._prefixes is None and reuse._prefixes is not None
    sites = list(plain.sites.values())
    seq = plans(sites, n=8) + plans(sites, n=4, seed=7)
    for i, plan in enumerate(seq):
        chunks = 1 if i % 5 == 4 else None  # a prefix of the chunks, as evolve scores
        np.testing.assert_array_equal(reuse.token_kls(plan, chunks), plain.token_kls(plan, chunks))
    # Every block of every chunk of every evaluation either ran or was stubbed.
    n_blocks = len(reuse.adapter.blocks)
    calls = sum(n_blocks * (1 if i % 5 == 4 else reuse.n_chunks) for i in range(len(seq)))
    assert reuse.evaluations == plain.evaluations == len(seq)
    assert reuse.blocks_skipped > 0 and reuse.blocks_run + reuse.blocks_skipped == calls


def test_a_small_store_still_gives_the_same_numbers(llama):
    """Evictions (a store of 6 block outputs: 1.5 evaluations' worth) never
    serve a stale one."""
    model, tokens = llama
    plain = JointEvaluator(model, tokens, chunk=3, reuse_blocks=False)
    tight = JointEvaluator(model, tokens, chunk=3, prefix_bytes=6 * (3 * 24 * 64 * 4))
    for plan in plans(list(plain.sites.values()), n=6, seed=5):
        np.testing.assert_array_equal(tight.token_kls(plan), plain.token_kls(plan))
    assert tight.blocks_skipped > 0 and tight._prefixes.bytes <= tight._prefixes.limit
    assert len(tight._prefixes) == 6


def test_an_assignment_scored_before_is_not_run_again(llama):
    model, tokens = llama
    ev = JointEvaluator(model, tokens, chunk=2)
    plan = plans(list(ev.sites.values()), n=0)[0]
    first = ev.joint_kl(plan)
    runs = ev.evaluations
    assert ev.joint_kl(dict(reversed(list(plan.items())))) == first  # order does not matter
    assert (ev.evaluations, ev.reused) == (runs, 1)
    ev.joint_kl(plan, chunks=1)  # another set of chunks is another evaluation
    assert ev.evaluations == runs + 1
    changed = dict(plan)
    changed[next(iter(plan))] = "8b_g64" if plan[next(iter(plan))] != "8b_g64" else "2b_g64"
    assert ev.joint_kl(changed) != first
    assert ev.evaluations == runs + 2


def test_a_forward_that_does_not_replay_is_not_reused(llama, monkeypatch):
    """A model whose output the stubs would not reproduce keeps plain evaluations."""
    import mixbits.measure.prefix as prefix

    model, tokens = llama
    monkeypatch.setattr(prefix, "well_formed", lambda calls, start, n: False)
    ev = JointEvaluator(model, tokens, chunk=2)
    assert ev._prefixes is None and "once each" in ev.reuse_reason
    plan = plans(list(ev.sites.values()), n=0)[0]
    np.testing.assert_allclose(ev.token_kls(plan), reference_kls(model, tokens, ev, plan),
                               rtol=2e-3, atol=1e-6)


def test_a_model_writing_into_a_block_output_gets_the_plain_numbers():
    """The model's code writes into block 1's output before block 2 reads
    it: a stored output must be what the block returned, and a stubbed
    block must hand out a new array, or the write is applied twice or lost."""
    from mlx_lm.models import llama as mlx_llama
    from mlx_lm.models.base import create_attention_mask

    class Writes(mlx_llama.LlamaModel):
        def __call__(self, inputs, cache=None, input_embeddings=None):
            h = self.embed_tokens(inputs)
            mask = create_attention_mask(h, None)
            for i, layer in enumerate(self.layers):
                h = layer(h, mask, cache=None)
                if i == 1:
                    h[..., :8] = 3 * h[..., :8]
            return self.norm(h)

    model, _ = build("llama", seed=4)
    model.model.__class__ = Writes
    tokens = np.random.default_rng(2).integers(0, 160, size=(2, 16))
    plain = JointEvaluator(model, tokens, chunk=2, reuse_blocks=False)
    reuse = JointEvaluator(model, tokens, chunk=2)
    assert reuse._prefixes is not None, reuse.reuse_reason
    for plan in plans(list(plain.sites.values()), n=8, seed=3):
        np.testing.assert_array_equal(reuse.token_kls(plan), plain.token_kls(plan))
    assert reuse.blocks_skipped >= 8


@pytest.mark.parametrize("name", ["llama", "llama_tied"])
def test_a_head_change_reuses_every_block_an_embedding_change_none(name):
    """The output head runs after every block: changing only it stubs all
    of them. A tied embedding (also the head) runs first: changing it runs all."""
    model, _ = build(name, seed=5)
    tokens = np.random.default_rng(4).integers(0, 160, size=(2, 16))
    plain = JointEvaluator(model, tokens, chunk=1, reuse_blocks=False)
    reuse = JointEvaluator(model, tokens, chunk=1)
    n = len(reuse.adapter.blocks)
    sites = reuse.sites
    head = [p for p, s in sites.items() if s.block is None and s.form != "embedding"]
    emb = [p for p, s in sites.items() if s.form == "embedding"]
    assert reuse._after == frozenset(head)
    base = {p: "4b_g64" for p in sites}
    for outside in (head, emb):
        if not outside:
            continue
        for c in ("4b_g64", "8b_g64"):
            plan = {**base, **{p: c for p in outside}}
            before = reuse.blocks_skipped
            np.testing.assert_array_equal(reuse.token_kls(plan), plain.token_kls(plan))
            if c == "8b_g64":
                assert reuse.blocks_skipped - before == (2 * n if outside is head else 0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_architecture_reuses_blocks_with_the_plain_numbers(name):
    """Hybrid, recurrent, MoE, AltUp and VLM-wrapped models: the check lets
    reuse on, and swap-like plans score bit for bit as plain evaluations."""
    from mixbits.measure.candidates import parse_candidate, supports

    model, _ = build(name, seed=2)
    tokens = np.random.default_rng(1).integers(0, 160, size=(2, 12))
    plain = JointEvaluator(model, tokens, chunk=1, reuse_blocks=False)
    reuse = JointEvaluator(model, tokens, chunk=1)
    assert reuse._prefixes is not None, reuse.reuse_reason
    c4 = parse_candidate("4b_g32")
    base = {s.path: "4b_g32" for s in plain.sites.values() if supports(c4, s)}
    rng = np.random.default_rng(0)
    for i in range(5):
        plan = dict(base)
        for p in (rng.choice(list(base), size=2, replace=False) if i else []):
            plan[str(p)] = "8b_g32"
        np.testing.assert_array_equal(reuse.token_kls(plan), plain.token_kls(plan))
    assert reuse.blocks_skipped > 0
