"""The quality protocol's test bed, shared by its contender tests
(test_kquant_protocol, test_mlxlm_contenders): a tiny random llama written
as an F32 GGUF and loaded as bench/quality_protocol.py loads its model
(float32, mixbits' layers patched in) under a JointEvaluator, and the
independent float64 KL its scores are checked against."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from gguf_build import write_model
from test_gguf_models import bpe_vocab


def float_llama_evaluator(path, tokens_shape, seed: int = 4):
    """(model, reference mlx-lm model, {"a": JointEvaluator}, tokens): the
    F32 GGUF at ``path`` loaded as the protocol loads a model, evaluated on
    random tokens of ``tokens_shape``."""
    from mixbits.measure.calib import cast_model
    from mixbits.measure.joint import JointEvaluator
    from mixbits.models.gguf import load_gguf
    from mixbits.nn import patch

    ref, _ = write_model(path, "llama", lambda p, s: T.F32, bpe_vocab("smollm"), tied=True, seed=seed)
    model, _, _ = load_gguf(path)
    cast_model(model, "float32")
    patch(model)
    tokens = np.random.default_rng(0).integers(0, 200, size=tokens_shape)
    return model, ref, {"a": JointEvaluator(model, tokens, chunk=2)}, tokens


def kl64(ref_logits, q_logits) -> np.ndarray:
    """Per-sequence mean KL(P_ref || Q) over tokens, in float64 numpy."""
    def logp(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = logp(np.asarray(ref_logits, np.float64)), logp(np.asarray(q_logits, np.float64))
    return (np.exp(lp) * (lp - lq)).sum(-1).mean(-1)
