"""What each supported GGUF architecture means in mlx-lm terms: tensor
names, config.json, and the conventions llama.cpp's converter applied to
the weights (checked against convert_hf_to_gguf / conversion/*.py):

- llama: q/k rows permuted per head from HF's half-split rope order to
  interleaved pairs (llama.cpp's LLAMA rope rotates adjacent pairs);
  undone here. qwen2, qwen3, gemma3 and phi3 use NEOX rope in llama.cpp,
  so their rows are stored in HF order.
- gemma3: every ``*norm.weight`` is stored as HF's value + 1 (Gemma's
  RMSNorm scales by 1 + w, llama.cpp's by w); mlx-lm's gemma3_text adds
  the 1 itself, so 1 is subtracted here. Layers follow a sliding-window
  pattern (default 6: five local layers, then a global one, as llama.cpp
  assumes when the file has no pattern key); local layers use
  ``rope.freq_base_swa`` (default 10,000).
- phi3: q/k/v and gate/up stay fused (``attn_qkv``, ``ffn_up``), as in
  mlx-lm's phi3 module.
"""

from __future__ import annotations

from ..errors import FormatError


class UnsupportedArchitecture(FormatError):
    """A GGUF file whose ``general.architecture`` mixbits cannot map to mlx-lm."""


_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_COMMON = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_LAYER_NAMES = {
    "llama": _COMMON,
    "qwen2": _COMMON,
    "qwen3": {**_COMMON, **_QK_NORM},
    "gemma3": {**_COMMON, **_QK_NORM, "ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {**_COMMON, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
SUPPORTED = tuple(_LAYER_NAMES)


def check_supported(meta: dict) -> str:
    arch = str(meta.get("general.architecture", ""))
    if arch not in _LAYER_NAMES:
        raise UnsupportedArchitecture(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED)})")
    return arch


def mlx_name(arch: str, gguf_name: str) -> str | None:
    """mlx-lm parameter path of a GGUF tensor; None for tensors mlx-lm
    computes itself (none so far); FormatError for unknown ones."""
    base, _, leaf = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, idx, part = base.split(".", 2)
        names = _LAYER_NAMES[arch]
        if part in names:
            return f"model.layers.{idx}.{names[part]}.{leaf}"
    elif base in _TOP:
        return f"{_TOP[base]}.{leaf}"
    if base == "rope_freqs":
        raise FormatError(f"GGUF tensor {gguf_name!r} (llama3-style rope frequency factors) is not "
                          "supported yet")
    raise FormatError(f"unexpected tensor {gguf_name!r} in a GGUF {arch} model")


def rope_permuted(arch: str) -> bool:
    return arch == "llama"


def norm_shift(arch: str, mlx_path: str) -> float:
    """What to add to a stored norm weight to get mlx-lm's parameter."""
    return -1.0 if arch == "gemma3" and mlx_path.endswith("norm.weight") else 0.0


# ---------------------------------------------------------------- config


class _Meta:
    def __init__(self, meta: dict, arch: str):
        self.meta, self.arch = meta, arch

    def has(self, key):
        return f"{self.arch}.{key}" in self.meta

    def int(self, key, default=None):
        k = f"{self.arch}.{key}"
        if k not in self.meta:
            if default is None:
                raise FormatError(f"GGUF metadata has no {k!r}")
            return default
        v = self.meta[k]
        if isinstance(v, list):  # per-layer arrays (e.g. head_count_kv) must be uniform here
            if len(set(v)) != 1:
                raise FormatError(f"GGUF {k} varies per layer ({v[:8]}...), which mlx-lm's "
                                  f"{self.arch} cannot express")
            v = v[0]
        return int(v)

    def float(self, key, default):
        # GGUF stores these as float32; keep float32 precision so 1e-5 reads
        # as 1e-05 in config.json, not 9.999999747378752e-06.
        k = f"{self.arch}.{key}"
        return float(f"{float(self.meta[k]):.7g}") if k in self.meta else default


def _rope_scaling(m: _Meta):
    kind = m.meta.get(f"{m.arch}.rope.scaling.type", "none")
    if kind in ("none", ""):
        return None
    if kind == "linear":
        return {"type": "linear", "rope_type": "linear", "factor": m.float("rope.scaling.factor", 1.0)}
    raise FormatError(f"GGUF {m.arch} rope scaling {kind!r} is not supported yet")


def config(arch: str, meta: dict, tensors: dict) -> dict:
    """mlx-lm config.json contents for a supported GGUF architecture."""
    m = _Meta(meta, arch)
    heads = m.int("attention.head_count")
    hidden = m.int("embedding_length")
    cfg = {
        "hidden_size": hidden,
        "num_hidden_layers": m.int("block_count"),
        "intermediate_size": m.int("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": m.int("attention.head_count_kv", heads),
        "rms_norm_eps": m.float("attention.layer_norm_rms_epsilon", 1e-5),
        "max_position_embeddings": m.int("context_length", 4096),
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    head_dim = m.int("attention.key_length", m.int("rope.dimension_count", hidden // heads))
    scaling = _rope_scaling(m)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    if arch == "llama":
        cfg.update(model_type="llama", head_dim=head_dim, rope_traditional=False,
                   rope_theta=m.float("rope.freq_base", 10000.0))
    elif arch == "qwen2":
        cfg.update(model_type="qwen2", rope_theta=m.float("rope.freq_base", 1000000.0))
    elif arch == "qwen3":
        cfg.update(model_type="qwen3", head_dim=head_dim, rope_theta=m.float("rope.freq_base", 1000000.0))
    elif arch == "gemma3":
        cfg.update(_gemma3(m, head_dim))
    elif arch == "phi3":
        cfg.update(_phi3(m, tensors, hidden // heads))
    for role in ("eos", "bos"):
        key = f"tokenizer.ggml.{role}_token_id"
        if key in meta:
            cfg[f"{role}_token_id"] = int(meta[key])
    return cfg


def _gemma3(m: _Meta, head_dim: int) -> dict:
    if m.float("final_logit_softcapping", 0.0):
        raise FormatError("GGUF gemma3 with final logit softcapping: mlx-lm's gemma3_text has none")
    window = m.int("attention.sliding_window", 0) if m.has("attention.sliding_window") else 0
    pattern = m.meta.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per-layer "is sliding" flags: must be periodic, global last
        period = pattern.index(False) + 1 if False in pattern else len(pattern) + 1
        if any(f != ((i + 1) % period != 0) for i, f in enumerate(pattern)):
            raise FormatError(f"GGUF gemma3 sliding-window layers {pattern} are not periodic")
        pattern = period
    layers = m.int("block_count")
    hidden, heads = m.int("embedding_length"), m.int("attention.head_count")
    return {
        "model_type": "gemma3_text",
        "head_dim": head_dim,
        "rope_theta": m.float("rope.freq_base", 1000000.0),
        "rope_local_base_freq": m.float("rope.freq_base_swa", 10000.0),
        # Gemma 3 27B scales queries by hidden/heads, the others by head_dim
        # (llama.cpp decides the same way, by its 62 layers).
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        # No window: every layer global (pattern 1).
        "sliding_window": window or 4096,
        "sliding_window_pattern": int(pattern) if window else 1,
    }


def _phi3(m: _Meta, tensors: dict, head_dim: int) -> dict:
    rot = m.int("rope.dimension_count", head_dim)
    out = {
        "model_type": "phi3",
        "rope_theta": m.float("rope.freq_base", 10000.0),
        "partial_rotary_factor": rot / head_dim,
        "original_max_position_embeddings": m.int("rope.scaling.original_context_length",
                                                  m.int("context_length", 4096)),
    }
    if "rope_factors_long.weight" in tensors:
        raise FormatError("GGUF phi3 with long-context rope factors is not supported yet")
    return out
