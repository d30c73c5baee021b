"""A tiny random llama (mlx-lm's class) for fast end-to-end tests."""

import mlx.core as mx
import numpy as np


def tiny_llama(seed: int = 0, layers: int = 2, hidden: int = 64, vocab: int = 256):
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, vocab_size=vocab, tie_word_embeddings=True,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    # Larger-than-default init so quantization error is visible in the KL.
    rng = np.random.default_rng(seed)
    params = {}
    for k, v in __import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(model.parameters()):
        if v.ndim == 2:
            params[k] = mx.array(rng.standard_normal(v.shape).astype(np.float32) / np.sqrt(v.shape[1]) * 1.5)
    model.load_weights(list(params.items()), strict=False)
    mx.eval(model.parameters())
    return model


def tiny_tokens(n: int = 4, t: int = 16, vocab: int = 256, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(n, t))
