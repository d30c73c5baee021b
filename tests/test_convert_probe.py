"""convert's timing probe times what refine runs: a joint evaluation of
the quantized model (every tensor a quantized layer, as refine's
assignments have them), not of the float model with one tensor quantized
(issue 40: on Llama-3-8B shapes in bf16 that float forward, 182 s per
sequence, was taken for refine's evaluation); and refine's projection
counts the reference pass and quantizing the layers; grad's measure
projection counts the Fisher pass over every measured tensor and the
proxy's rating of every (tensor, candidate) pair (it counted the Fisher
pass of one tensor only: ~2 min projected on SmolLM2-135M where 13-15 min
were measured); refine's counts the evaluator's reuse."""

import mlx.nn as nn
import numpy as np

import mixbits.measure.joint as joint
from mixbits.adapter import ModelAdapter
import mixbits.convert as conv
import mixbits.measure.grad as grad
from mixbits.convert import GUARD_EVALS, REUSE, Probe, timing_probe
from mixbits.measure.candidates import parse_candidate, supports
from mixbits.nn import MixedQuantizedEmbedding, MixedQuantizedLinear
from tiny_models import build


def test_the_probes_joint_evaluation_runs_every_tensor_quantized(monkeypatch):
    model, _ = build("llama", seed=1)
    tokens = np.random.default_rng(0).integers(0, 160, size=(3, 16))
    sites = ModelAdapter(model).sites
    seen = []
    kl = joint.kl_per_token

    def looking(ref, logits):
        # What the forward that made these logits ran with.
        mods = dict(model.named_modules())
        seen.append({s.path: type(mods[s.path]) for s in sites})
        return kl(ref, logits)

    monkeypatch.setattr(joint, "kl_per_token", looking)
    probe = timing_probe(model, tokens, sites, ["2b_g64", "4b_g64", "8b_g64"], bpw=4.5)
    assert len(seen) == 1  # the probe's one joint evaluation
    kinds = seen[0]
    assert all(issubclass(k, (MixedQuantizedLinear, MixedQuantizedEmbedding)) for k in kinds.values()), \
        {p: k.__name__ for p, k in kinds.items() if issubclass(k, (nn.Linear, nn.Embedding))}
    # The model is as loaded again afterwards.
    assert all(isinstance(dict(model.named_modules())[s.path], (nn.Linear, nn.Embedding)) for s in sites)
    assert probe.joint_seq > 0 and probe.reference_seq > 0 and probe.build_set > 0
    assert probe.candidates == 3


def test_refine_projection_counts_reference_pass_and_layer_builds():
    p = Probe(n_seq=8, fisher_seq=1.0, pair=(0.5, 0.1), pair_units=[10], joint_seq=2.0,
              reference_seq=3.0, build_set=5.0, candidates=6)
    # 8 x 3 s reference, 2 sets of layers per budget (at most 6); per budget the search's first
    # evaluation and the guard's 4 whole, its 29 later ones at REUSE of one, each 8 x 2 s
    assert GUARD_EVALS == 4 and 0 < REUSE < 1
    assert p.refine_seconds([3.5], 30) == 8 * 3.0 + 2 * 5.0 + (1 + 4 + 29 * REUSE) * 8 * 2.0
    assert p.refine_seconds([3.5, 4.0, 4.5, 5.0], 0) == 8 * 3.0 + 6 * 5.0 + 4 * 4 * 8 * 2.0
    # one search per menu and budget: two menus, twice the evaluations (the layers shared)
    p.refines = 2
    assert p.refine_seconds([3.5], 30) == 8 * 3.0 + 4 * 5.0 + 2 * (1 + 4 + 29 * REUSE) * 8 * 2.0


def test_grad_measure_projection_counts_fisher_and_every_pair_rating():
    p = Probe(n_seq=8, fisher_seq=3.0, pair=(0.5, 0.1), pair_units=[10] * 6, joint_seq=2.0,
              rate_units=[0.25] * 6, hessian_blocks=2)
    # 8 sequences x 2 samples x 3 s, 6 pairs x 0.25 s, 2 blocks' X^T X replays x 8 sequences x 0.1 s
    want = 8 * 2 * 3.0 + 6 * 0.25 + 2 * 8 * 0.1
    assert p.stage_seconds("grad", [3.5], 30, 0.15, 2)["measure"] == want
    exact = 8 * 6 * (0.5 + 0.1 * 10)
    assert p.stage_seconds("two-stage", [3.5], 30, 0.15, 2)["measure"] == want + 0.15 * exact


class _Clock:
    """Every reading one second after the last: each timed interval is 1 s."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t


def _sites_and_originals(model):
    ad = ModelAdapter(model)
    return ad.sites, {s.path: ad.get(s.path) for s in ad.sites}


def test_rating_probe_counts_each_candidate_of_each_tensor_by_its_size(monkeypatch):
    """With every rating timed at 1 s: one unit per (tensor, candidate) pair,
    in the pairs' order, each the tensor's weights over the weights it was
    timed on. Cut to one or two rows (RATE_SLICE below a row and a half of
    the widest tensor), a tensor's unit is its rows over the cut's."""
    model, _ = build("llama", seed=1)
    sites, originals = _sites_and_originals(model)
    counts = {}
    for names in (["4b_g64"], ["2b_g64", "4b_g64"], ["2b_g64", "3b_g64", "4b_g64", "8b_g64"]):
        cands = [parse_candidate(c) for c in names]
        pairs = [(s, c) for s in sites for c in cands if supports(c, s)]
        units = conv._rating_probe(originals, sites, cands, clock=_Clock())
        assert units == [1.0] * len(pairs)  # uncut: the tensor's own time, each pair once
        counts[len(names)] = sum(units)
        monkeypatch.setattr(conv, "RATE_SLICE", 1)  # one row each
        cut = conv._rating_probe(originals, sites, cands, clock=_Clock())
        monkeypatch.undo()
        assert cut == [float(s.shape[0]) for s, c in pairs]
    assert counts[2] == 2 * counts[1] and counts[4] == 4 * counts[1] == 4 * len(sites)


def test_rating_stand_in_does_the_rows_work_of_the_whole_tensor():
    """A cut tensor's candidate is the whole tensor's candidate's first rows
    (the same quantizing work per row, so its time per weight carries over);
    a mixed kind's column split is chosen on the rows it is given, so there
    the cut has the same segments (bits, group size, columns), not the same
    permutation."""
    import mlx.core as mx

    from mixbits.adapter import dense_weight, quantized_form
    from mixbits.measure.candidates import build_layer

    model, _ = build("llama", seed=1)
    sites, originals = _sites_and_originals(model)
    for s in sites:
        if s.form == "stack":
            continue
        cut, n = conv._rate_stand_in(originals[s.path], s, 3)
        assert n == 3 * s.shape[1]
        for name in ("3b_g64", "4b10_3b_g64"):
            c = parse_candidate(name)
            if not supports(c, s):
                continue
            whole, part = build_layer(originals[s.path], c), build_layer(cut, c)
            specs = [[g.spec for g in quantized_form(m).segments] for m in (whole, part)]
            assert specs[0] == specs[1], (s.path, name)
            assert dense_weight(part).shape == (3, s.shape[1])
            if c.kind != "mixed":
                assert mx.array_equal(dense_weight(part), dense_weight(whole)[:3]).item(), (s.path, name)


def test_the_probes_fisher_pass_covers_every_measured_tensor(monkeypatch):
    """The measure stage's Fisher pass sums every measured tensor's squared
    gradients; the probe times that pass, not one tensor's."""
    model, _ = build("llama", seed=1)
    tokens = np.random.default_rng(0).integers(0, 160, size=(2, 16))
    sites = ModelAdapter(model).sites
    seen = []
    stream = grad.fisher_stream

    def recording(model, tokens, sites, **kw):
        seen.append(([s.path for s in sites], np.asarray(tokens).shape, kw.get("samples")))
        yield from stream(model, tokens, sites, **kw)

    monkeypatch.setattr(grad, "fisher_stream", recording)
    cands = ["2b_g64", "4b_g64"]
    probe = timing_probe(model, tokens, sites, cands, bpw=4.5)
    measured = [s.path for s in sites if any(supports(parse_candidate(c), s) for c in cands)]
    assert seen == [(measured, (1, 16), 1)]
    assert len(probe.rate_units) == probe.pairs == 2 * len(measured)
    assert probe.fisher_seq > 0 and all(r > 0 for r in probe.rate_units)


def test_the_probe_times_calibrated_menus_too():
    """convert's default menus are all +search kinds: the probe must still
    time the exact pairs and the joint evaluation (on their round-to-
    nearest twins, which run at the same speed). It dropped calibrated
    kinds, so with the defaults both were 0 s and --time-budget took the
    exact sweep as free."""
    model, _ = build("llama", seed=2)
    tokens = np.random.default_rng(0).integers(0, 160, size=(2, 16))
    sites = ModelAdapter(model).sites
    probe = timing_probe(model, tokens, sites, ["2b_g64+search", "4b_g64+search", "4b10_3b_g64+search"],
                         bpw=4.5)
    assert probe.joint_seq > 0 and probe.build_set > 0
    assert probe.pair[0] + probe.pair[1] > 0
    assert conv.timing_kinds([parse_candidate(k) for k in ("4b_g64+search", "4b_g64", "3b_g64+gptq")]) == \
        [parse_candidate("4b_g64"), parse_candidate("3b_g64")]
