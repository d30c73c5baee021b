"""Tiny random-weight mlx-lm models of many architectures, built from
mlx-lm's own model classes (no downloads): the test bed for everything
that must work on any model."""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

_BASE = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=160, head_dim=16,
             max_position_embeddings=512, rope_theta=10000.0)

_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
            mlp_only_layers=[], norm_topk_prob=True)

_HYBRID = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
               partial_rotary_factor=0.25)

CONFIGS = {
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "llama_tied": dict(model_type="llama", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True),
    "qwen3_moe": dict(model_type="qwen3_moe", tie_word_embeddings=False, **_MOE),
    "qwen3_next": dict(model_type="qwen3_next", tie_word_embeddings=False, **_MOE, **_HYBRID,
                       shared_expert_intermediate_size=64),
    "qwen3_5": dict(model_type="qwen3_5", tie_word_embeddings=False, **_HYBRID),
    "qwen3_5_vlm": dict(model_type="qwen3_5", tie_word_embeddings=False,
                    text_config=dict(model_type="qwen3_5_text", tie_word_embeddings=False,
                                     **_BASE, **_HYBRID)),
    "gemma3_text": dict(model_type="gemma3_text", sliding_window=8, sliding_window_pattern=2,
                        query_pre_attn_scalar=16),
    "gemma3": dict(model_type="gemma3", vocab_size=160,
                   text_config=dict(**{k: v for k, v in _BASE.items() if k != "vocab_size"},
                                    model_type="gemma3_text",
                                    sliding_window=8, sliding_window_pattern=2,
                                    query_pre_attn_scalar=16)),
    "ministral3": dict(model_type="ministral3", sliding_window=8, tie_word_embeddings=False,
                       layer_types=["sliding_attention", "full_attention"] * 2,
                       rope_parameters=dict(rope_theta=10000.0, llama_4_scaling_beta=0.1,
                                            original_max_position_embeddings=64)),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe", tie_word_embeddings=False, **_MOE, **_HYBRID,
                        shared_expert_intermediate_size=64),
    "phi3": dict(model_type="phi3", tie_word_embeddings=False),
    "deepseek_v3": dict(model_type="deepseek_v3", tie_word_embeddings=False, kv_lora_rank=16,
                        q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                        n_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1,
                        n_group=1, topk_group=1, routed_scaling_factor=1.0),
    # Multi-head latent attention with key heads (16 + 8) wider than value
    # heads (8): attention calls outside the kernel's contract.
    "deepseek_v2": dict(model_type="deepseek_v2", tie_word_embeddings=False, kv_lora_rank=16,
                        q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=16,
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                        n_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1,
                        n_group=1, topk_group=1, routed_scaling_factor=1.0,
                        rope_scaling=dict(factor=1.0, original_max_position_embeddings=512,
                                          beta_fast=32, beta_slow=1, mscale=1.0,
                                          mscale_all_dim=0)),
    "minicpm3": dict(model_type="minicpm3", dim_model_base=64, num_key_value_heads=4, q_lora_rank=32,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, kv_lora_rank=16, v_head_dim=16,
                     scale_depth=1.4, scale_emb=12,
                     rope_scaling=dict(type="longrope", long_factor=[1.0] * 4,
                                       short_factor=[1.0] * 4,
                                       original_max_position_embeddings=512)),
    # Recurrent and other non-transformer blocks; tensors no group size
    # divides (mamba's dt_proj K=4, gemma3n's AltUp coefficients K=4,
    # laurel K=8) stay float.
    "mamba": dict(model_type="mamba", state_size=8, conv_kernel=4, use_bias=False,
                  use_conv_bias=True, time_step_rank=4, tie_word_embeddings=True),
    "rwkv7": dict(model_type="rwkv7", norm_eps=1e-5, a_low_rank_dim=64, v_low_rank_dim=32,
                  gate_low_rank_dim=64, decay_low_rank_dim=64, tie_word_embeddings=False),
    "recurrent_gemma": dict(model_type="recurrent_gemma", attention_bias=False, conv1d_width=4,
                            logits_soft_cap=30.0, num_key_value_heads=1, rms_norm_eps=1e-6,
                            attention_window_size=16,
                            block_types=["recurrent", "recurrent", "attention"]),
    "gemma3n": dict(model_type="gemma3n", text_config=dict(
        model_type="gemma3n_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, head_dim=16, rms_norm_eps=1e-6, vocab_size=160,
        num_key_value_heads=2, num_kv_shared_layers=2, vocab_size_per_layer_input=160,
        sliding_window=8, max_position_embeddings=512, rope_local_base_freq=10000.0,
        rope_theta=1000000.0, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0], hidden_size_per_layer_input=16,
        altup_num_inputs=4, altup_coef_clip=120.0, altup_correct_scale=True, altup_active_idx=0,
        laurel_rank=8)),
    "gpt_oss": dict(model_type="gpt_oss", tie_word_embeddings=False, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=8, head_dim=16,
                    layer_types=["sliding_attention", "full_attention"] * 2),
}


def config(name: str) -> dict:
    cfg = copy.deepcopy(_BASE)
    cfg.update(copy.deepcopy(CONFIGS[name]))
    return cfg


def build(name: str, seed: int = 0, dtype=mx.float32):
    """(model, config) with random weights, in ``dtype``."""
    from mlx_lm.utils import _get_classes

    cfg = config(name)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    # Random init makes some norms/biases zero or one; perturb every float
    # parameter a little so no tensor is trivially insensitive.
    params = tree_flatten(model.parameters())
    key = mx.random.key(seed + 1)
    new = []
    for i, (k, v) in enumerate(params):
        if mx.issubdtype(v.dtype, mx.floating):
            noise = mx.random.normal(v.shape, key=mx.random.split(key, len(params))[i]) * 0.02
            v = (v + noise).astype(dtype)
        new.append((k, v))
    model.load_weights(new, strict=False)
    mx.eval(model.parameters())
    model.eval()
    return model, cfg


def llama_writing_into_block(block: int = 2, seed: int = 0):
    """The tiny llama whose forward writes in place into ``block``'s output
    (the same array object afterwards, so the recorded calls still look
    chained): what the block-wise Fisher pass must detect and fall back on.
    The model's own layers run; only the loop around them is replaced."""
    from mlx_lm.models import llama
    from mlx_lm.models.base import create_attention_mask

    class Writes(llama.LlamaModel):
        def __call__(self, inputs, cache=None, input_embeddings=None):
            h = self.embed_tokens(inputs)
            mask = create_attention_mask(h, None)
            for i, layer in enumerate(self.layers):
                h = layer(h, mask, cache=None)
                if i == block:
                    h[..., :8] = 3 * h[..., :8]
            return self.norm(h)

    model, cfg = build("llama", seed=seed)
    model.model.__class__ = Writes
    return model, cfg
