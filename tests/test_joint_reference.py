"""The joint evaluator's lighter reference (``reference="probs16"``: a
mixbits.kl.KLReference per chunk, half the bytes of float32 logits), what
makes Gemma-3-270M's 262,144-token vocabulary fit the quality protocol and
convert's refine: its per-sequence KL against an independent one -- the
model's own float forward and its forward with the evaluator's layers
swapped in, KL in float64 numpy -- and against the float32 path, on a tiny
model, on SmolLM2 (V = 49,152) and on two Gemma-3-270M sequences; and the
"auto" rule that picks it by the float32 reference's size."""

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mixbits.adapter import ModelAdapter
from mixbits.measure import joint
from mixbits.measure.joint import JointEvaluator
from tiny_models import build

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

# Tolerances, per-sequence mean KL relative to float64 numpy on the same
# batches (measured worst: float32 2e-8, probs16 8e-6 on Gemma-3-270M on an
# AVX2-only EPYC; ~2e-5 on SmolLM2 and Gemma-3-270M on an AVX-512 Xeon,
# bench/KL.md's 1e-5..1.5e-4 on the mean at KL 5e-3..4e-4): probs16 is
# KL(P16 || Q), P16 the reference rounded to 11 significant bits.
RTOL_F32, RTOL_P16 = 2e-5, 5e-5


def float64_kls(ev: JointEvaluator, plan: dict[str, str]) -> np.ndarray:
    """Per-sequence mean KL(P_float || Q_plan) in float64 numpy: P from the
    model's own forward, Q from the forward with the evaluator's built layer
    in place of each planned tensor (restored after). The forwards batch the
    sequences as the evaluator does (``ev.chunk`` at a time): a float32
    forward is not batch-invariant (a matmul's blocking depends on its row
    count), and on Gemma-3-270M the same window alone and beside another
    differs by 0.3% in its logits on an AVX2-only EPYC, 5e-5 in its KL --
    the forward's rounding, not the reference form under test."""
    def logp(x):
        x = np.asarray(x, dtype=np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    model, out = ev.model, []
    for i in range(0, len(ev.tokens), ev.chunk):
        x = mx.array(ev.tokens[i : i + ev.chunk])
        ps = np.array(model(x).astype(mx.float32))
        try:
            for path, cand in plan.items():
                ev.adapter.set(path, ev.layer(path, cand))
            qs = np.array(model(x).astype(mx.float32))
        finally:
            for path in plan:
                ev.adapter.set(path, ev.originals[path])
        for p, q in zip(ps, qs):  # a sequence at a time in float64
            lp, lq = logp(p), logp(q)
            out.append((np.exp(lp) * (lp - lq)).sum(-1).mean())
        del ps, qs, lp, lq
    return np.array(out)


def check_forms(model, tokens, plans, chunk=2):
    """Both forms against float64 numpy and each other; returns the worst
    relative errors (float32, probs16) and the vocabulary."""
    f32 = JointEvaluator(model, tokens, chunk=chunk, reference="logits")
    p16 = JointEvaluator(model, tokens, chunk=chunk, reference="probs16", calibration=f32)
    assert f32.reference == "logits" and p16.reference == "probs16"
    assert all(isinstance(r, mx.array) for r in f32.ref_logits)
    assert sum(r.nbytes for r in p16.ref_logits) * 2 == sum(r.nbytes for r in f32.ref_logits)
    worst = [0.0, 0.0]
    for plan in plans:
        want = float64_kls(f32, plan)
        assert want.min() > 1e-3  # the plan changed the model
        a, b = f32.sequence_kls(plan), p16.sequence_kls(plan)
        np.testing.assert_allclose(a, want, rtol=RTOL_F32)
        np.testing.assert_allclose(b, want, rtol=RTOL_P16)
        np.testing.assert_allclose(b, a, rtol=RTOL_P16)
        worst = [max(worst[0], float(np.max(np.abs(a / want - 1)))), max(worst[1], float(np.max(np.abs(b / want - 1))))]
    # the unquantized model against itself scores ~0 in both forms
    assert np.abs(p16.sequence_kls({})).max() < 1e-4
    return worst, f32.ref_logits[0].shape[-1]


def sites(model):
    return [s.path for s in ModelAdapter(model).sites]


def test_probs16_reference_matches_float64_on_a_tiny_model():
    model, _ = build("llama_tied", seed=3)
    tokens = np.random.default_rng(0).integers(0, 160, size=(3, 24))
    plans = [{p: k for p in sites(model)} for k in ("2b_g64", "3b_g64", "4b_g32")]
    check_forms(model, tokens, plans)


def test_auto_picks_probs16_only_above_the_float32_limit(monkeypatch):
    model, _ = build("llama_tied", seed=3)
    tokens = np.random.default_rng(0).integers(0, 160, size=(3, 24))
    whole = 3 * 24 * 160 * 4  # float32 logits of all the tokens
    assert JointEvaluator(model, tokens, chunk=2).reference == "logits"
    monkeypatch.setattr(joint, "REFERENCE_F32_LIMIT", whole)  # at the limit: float32 still
    assert JointEvaluator(model, tokens, chunk=2).reference == "logits"
    monkeypatch.setattr(joint, "REFERENCE_F32_LIMIT", whole - 1)  # the whole set, not the first chunk
    ev = JointEvaluator(model, tokens, chunk=2)
    assert ev.reference == "probs16" and len(ev.ref_logits) == 2
    with pytest.raises(ValueError, match="reference must be one of"):
        JointEvaluator(model, tokens, reference="float16")


def _real(name, n_seq):
    """The model as the quality protocol scores it (float32, mixbits' kernels)
    and the first ``n_seq`` of its held-out license windows."""
    import mixbits
    from mixbits.measure.calib import cast_model
    from mixbits.nn import patch
    from quality_protocol import token_sets

    model, tok, _ = mixbits.load(name)
    cast_model(model, "float32")
    patch(model)
    return model, token_sets(tok, [])[1]["licenses"][:n_seq]


def test_probs16_reference_matches_float64_on_smollm2():
    model, tokens = _real("smollm2", 4)
    worst, vocab = check_forms(model, tokens, [{p: k for p in sites(model)} for k in ("3b_g64", "4b_g64")])
    assert vocab == 49152
    print("smollm2 worst relative error (float32, probs16):", worst)


def test_probs16_reference_matches_float64_on_gemma3():
    model, tokens = _real("gemma3", 2)
    worst, vocab = check_forms(model, tokens, [{p: "4b_g64" for p in sites(model)}])
    assert vocab == 262144
    # the 8 x 256 calibration set's float32 logits are over the limit: "auto" holds it as probs16
    assert 8 * 256 * vocab * 4 > joint.REFERENCE_F32_LIMIT
    print("gemma3 worst relative error (float32, probs16):", worst)


def test_an_evaluator_sharing_a_reference_scores_as_one_with_its_own():
    """quality_protocol's evaluators fitted on a seed's calibration tokens
    take the held-out reference of the scorer's own (same model and tokens)."""
    model, _ = build("llama_tied", seed=3)
    rng = np.random.default_rng(0)
    held, cal_tokens = rng.integers(0, 160, size=(3, 24)), rng.integers(0, 160, size=(4, 24))
    plan = {p: "3b_g64+search" for p in sites(model)}
    for form in ("logits", "probs16"):
        scorer = JointEvaluator(model, held, chunk=2, reference=form)
        cal = JointEvaluator(model, cal_tokens, chunk=2)
        own = JointEvaluator(model, held, chunk=2, calibration=cal, reference=form)
        shared = JointEvaluator(model, held, chunk=2, calibration=cal, same_reference=scorer)
        assert shared.ref_logits is scorer.ref_logits and shared.reference == form
        got = shared.sequence_kls(plan)
        np.testing.assert_array_equal(got, own.sequence_kls(plan))
        np.testing.assert_allclose(got, float64_kls(shared, plan), rtol=RTOL_P16 if form == "probs16" else RTOL_F32)
        # the scorer's own (uncalibrated: fitted on the held-out tokens) differs: the sharing is only of the reference
        assert not np.allclose(scorer.sequence_kls(plan), got, rtol=1e-3)
    for bad in (dict(tokens=held[:2]), dict(chunk=1), dict(reference="logits")):
        kw = {"tokens": held, "chunk": 2, **bad}
        with pytest.raises(ValueError, match="same_reference"):
            JointEvaluator(model, kw.pop("tokens"), calibration=cal, same_reference=scorer, **kw)
