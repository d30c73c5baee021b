"""Build an MLX llama model from a GGUF file, keeping its quantized weights.

``mx.load`` reads GGUF Q4_0/Q4_1/Q8_0 tensors straight into MLX affine
triplets (``<name>.weight`` uint32, ``.scales``, ``.biases``); Q4_1 becomes
4-bit group-32 and Q8_0 8-bit group-32. Those triplets become
``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding`` layers of mlx-lm's
llama model without re-quantizing.

Rotary embedding order: llama.cpp's converter permutes the rows of the q
and k projections of each head from HF's half-split order ([x0..x63] with
pairs (i, i+32)) into interleaved pairs (2i, 2i+1), because llama.cpp's
LLAMA rope rotates adjacent pairs. We undo that row permutation (rows are
whole quantization groups, so it is exact on the quantized storage) and
use mlx-lm's default, non-traditional rope -- the weights then match the
original HF checkpoint layout and any folder we save is a normal llama.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .tokenizer import Tokenizer

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _mlx_name(gguf_name: str) -> str:
    base, _, leaf = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, idx, part = base.split(".", 2)
        if part not in _LAYER_NAMES:
            raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
        return f"model.layers.{idx}.{_LAYER_NAMES[part]}.{leaf}"
    if base not in _TOP_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"{_TOP_NAMES[base]}.{leaf}"


def _int(meta, key):
    if key not in meta:
        raise ValueError(f"GGUF metadata has no {key!r}")
    return int(meta[key].item())


def _float(meta, key, default):
    # GGUF stores these as float32; print them back at float32 precision so
    # 1e-5 reads as 1e-05 in config.json, not 9.999999747378752e-06.
    return float(f"{float(meta[key].item()):.7g}") if key in meta else default


def config_from_metadata(meta: dict, tensors: dict) -> dict:
    """mlx-lm llama config.json contents from GGUF ``llama.*`` metadata."""
    arch = str(meta.get("general.architecture", ""))
    if arch != "llama":
        raise ValueError(f"only GGUF llama models are supported, got architecture {arch!r}")
    n_head = _int(meta, "llama.attention.head_count")
    hidden = _int(meta, "llama.embedding_length")
    cfg = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": _int(meta, "llama.block_count"),
        "intermediate_size": _int(meta, "llama.feed_forward_length"),
        "num_attention_heads": n_head,
        "num_key_value_heads": _int(meta, "llama.attention.head_count_kv")
        if "llama.attention.head_count_kv" in meta
        else n_head,
        "head_dim": _int(meta, "llama.rope.dimension_count")
        if "llama.rope.dimension_count" in meta
        else hidden // n_head,
        "rms_norm_eps": _float(meta, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _float(meta, "llama.rope.freq_base", 10000.0),
        "rope_traditional": False,
        "max_position_embeddings": _int(meta, "llama.context_length")
        if "llama.context_length" in meta
        else 4096,
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if "tokenizer.ggml.eos_token_id" in meta:
        cfg["eos_token_id"] = int(meta["tokenizer.ggml.eos_token_id"].item())
    if "tokenizer.ggml.bos_token_id" in meta:
        cfg["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"].item())
    return cfg


def unpermute_rope_rows(a: mx.array, n_heads: int) -> mx.array:
    """Inverse of llama.cpp's q/k row permutation: interleaved pairs back to
    HF's half-split order. ``a`` is any per-row array (weight codes, scales,
    biases) with n_heads * head_dim rows."""
    rows = a.shape[0]
    head_dim = rows // n_heads
    rest = a.shape[1:]
    return a.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _quant_params(weights: dict, prefix: str, in_dims: int) -> dict:
    w, s = weights[f"{prefix}.weight"], weights[f"{prefix}.scales"]
    return {"group_size": in_dims // s.shape[-1], "bits": w.shape[-1] * 32 // in_dims, "mode": "affine"}


def load_gguf(path, *, undo_rope_permutation: bool = True):
    """(model, tokenizer, config) from a llama GGUF file.

    ``config`` is what a saved folder's config.json holds, including the
    mlx-lm ``quantization`` dict with one entry per quantized module.
    With ``undo_rope_permutation=False`` the q/k rows stay in GGUF order
    and the model uses traditional (interleaved) rope instead; both give
    the same outputs.
    """
    from mlx_lm.models import llama

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    raw, meta = mx.load(str(path), return_metadata=True)
    cfg = config_from_metadata(meta, raw)
    weights = {_mlx_name(k): v for k, v in raw.items()}
    if undo_rope_permutation:
        for i in range(cfg["num_hidden_layers"]):
            for proj, heads in (("q_proj", cfg["num_attention_heads"]), ("k_proj", cfg["num_key_value_heads"])):
                for leaf in ("weight", "scales", "biases"):
                    key = f"model.layers.{i}.self_attn.{proj}.{leaf}"
                    if key in weights:
                        weights[key] = unpermute_rope_rows(weights[key], heads)
    else:
        cfg["rope_traditional"] = True

    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    per_path = {}

    def predicate(p, m):
        if f"{p}.scales" not in weights:
            return False
        in_dims = m.weight.shape[-1]
        per_path[p] = _quant_params(weights, p, in_dims)
        return per_path[p]

    nn.quantize(model, class_predicate=predicate)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()

    if per_path:
        counts = {}
        for q in per_path.values():
            counts[(q["group_size"], q["bits"])] = counts.get((q["group_size"], q["bits"]), 0) + 1
        gs, bits = max(counts, key=counts.get)
        quant = {"group_size": gs, "bits": bits, "mode": "affine"}
        quant.update({p: {"group_size": q["group_size"], "bits": q["bits"]} for p, q in per_path.items()})
        cfg["quantization"] = quant
        cfg["quantization_config"] = dict(quant)
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    return model, tokenizer, cfg
