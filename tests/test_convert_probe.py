"""convert's timing probe times what refine runs: a joint evaluation of
the quantized model (every tensor a quantized layer, as refine's
assignments have them), not of the float model with one tensor quantized
(issue 40: on Llama-3-8B shapes in bf16 that float forward, 182 s per
sequence, was taken for refine's evaluation); and refine's projection
counts the reference pass and quantizing the layers."""

import mlx.nn as nn
import numpy as np

import mixbits.measure.joint as joint
from mixbits.adapter import ModelAdapter
from mixbits.convert import Probe, timing_probe
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
    # 8 x 3 s reference, 2 sets of layers per budget (at most 6), (30 + 4) x 8 x 2 s per budget
    assert p.refine_seconds([3.5], 30) == 8 * 3.0 + 2 * 5.0 + 34 * 8 * 2.0
    assert p.refine_seconds([3.5, 4.0, 4.5, 5.0], 0) == 8 * 3.0 + 6 * 5.0 + 4 * 4 * 8 * 2.0
