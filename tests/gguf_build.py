"""Write small GGUF files the way llama.cpp's converter lays them out, from
random weights, and keep the mlx-lm reference model those bytes decode to.

The reference side is independent of mixbits' loader: values come from
gguf-py's own ``dequantize`` of the exact bytes written, names and
conventions (llama q/k row interleave, Gemma norm + 1) are restated here
from llama.cpp's converter, and the model is mlx-lm's class.

K-quant and IQ blocks cannot be produced by gguf-py's quantizer, so their
blocks are random bytes with the fp16 super-block scales set to sane
values; what they decode to (by gguf-py) is the reference.
"""

from __future__ import annotations

import numpy as np

import gguf
import mlx.core as mx
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten

import tiny_models

# Byte offsets of the fp16 scale fields in one block of each constructed type.
_F16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
               T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.IQ2_XXS: (0,)}
CONSTRUCTED = tuple(_F16_FIELDS)

_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
}
_GEMMA_BLOCK = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
SP = "\u2581"
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3", "phi3": "phi3"}


def gguf_name(model_type: str, path: str) -> str:
    module, leaf = path.rsplit(".", 1)
    if module in _TOP:
        return f"{_TOP[module]}.{leaf}"
    _, _, idx, rest = module.split(".", 3)
    table = {**_BLOCK, **_GEMMA_BLOCK} if model_type == "gemma3_text" else _BLOCK
    return f"blk.{idx}.{table[rest]}.{leaf}"


def interleave_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's llama q/k permutation: HF row j*hd/2+i of a head goes to 2i+j."""
    out = np.empty_like(w)
    hd = w.shape[0] // n_heads
    for h in range(n_heads):
        for i in range(hd // 2):
            for j in range(2):
                out[h * hd + 2 * i + j] = w[h * hd + j * hd // 2 + i]
    return out


def constructed_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Random blocks of a type gguf-py cannot quantize to, decoding to weights of std ~0.05."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)

    def set_scale(v):
        for off in _F16_FIELDS[qtype]:
            raw[..., off:off + 2] = np.frombuffer(np.float16(v).tobytes(), np.uint8)

    set_scale(1.0)
    std = float(gguf.quants.dequantize(raw.reshape(rows, -1), qtype).std())
    set_scale(0.05 / std)
    return raw.reshape(rows, -1)


def encode_tensor(w: np.ndarray, qtype, rng):
    """(bytes or float array to write, the float32 values a reader must get)."""
    if qtype == T.F32:
        return w.astype(np.float32), w.astype(np.float32)
    if qtype == T.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    if qtype in CONSTRUCTED:
        data = constructed_blocks(qtype, *w.shape, rng)
    else:
        data = gguf.quants.quantize(w.astype(np.float32), qtype)
    return data, gguf.quants.dequantize(data, qtype).reshape(w.shape)


def tiny_config(name: str, **over) -> dict:
    cfg = tiny_models.config("llama" if name == "qwen2" else name)
    if name == "qwen2":
        cfg.update(model_type="qwen2", tie_word_embeddings=False)
    # 256 columns everywhere: K-quant blocks hold 256 weights.
    cfg.update(hidden_size=256, intermediate_size=256, head_dim=64, **over)
    if name == "gemma3_text":
        cfg["query_pre_attn_scalar"] = 64
    return cfg


def write_model(path, name: str, types, tokenizer: dict, *, seed: int = 0, tied=None, **over):
    """Write a GGUF of a random ``name`` model; returns the reference mlx-lm model.

    ``types``: a function (mlx-lm path, shape) -> ggml type for matrices
    (norms and biases are F32, as llama.cpp writes them).
    """
    from mlx_lm.utils import _get_classes

    cfg = tiny_config(name, vocab_size=len(tokenizer["tokens"]), **over)
    if tied is not None:
        cfg["tie_word_embeddings"] = tied
    model_cls, args_cls = _get_classes(cfg)
    ref = model_cls(args_cls.from_dict(cfg))
    rng = np.random.default_rng(seed)
    params = dict(tree_flatten(ref.parameters()))
    if cfg.get("tie_word_embeddings", name == "gemma3_text"):
        params.pop("lm_head.weight", None)
    arch = GGUF_ARCH[name]
    w = gguf.GGUFWriter(str(path), arch)
    _write_hparams(w, arch, cfg)
    _write_tokenizer(w, tokenizer)
    values = {}
    for p, v in params.items():
        shape = tuple(v.shape)
        is_norm = p.endswith("norm.weight")
        f = (1.0 if is_norm and name != "gemma3_text" else 0.0) + rng.normal(0, 0.1 if is_norm else 0.05, shape)
        if is_norm and name == "gemma3_text":
            f = f + 1.0  # llama.cpp stores Gemma norms as 1 + w
        if name == "llama" and p.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in p else cfg["num_key_value_heads"]
            f = interleave_rope_rows(f, heads)
        qtype = T.F32 if len(shape) == 1 else types(p, shape)
        data, decoded = encode_tensor(f, qtype, rng)
        if name == "llama" and p.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in p else cfg["num_key_value_heads"]
            decoded = _undo_interleave(decoded, heads)
        if is_norm and name == "gemma3_text":
            decoded = decoded - 1.0
        values[p] = decoded
        if qtype in (T.F32, T.F16):
            w.add_tensor(gguf_name(name, p), data)
        else:
            w.add_tensor(gguf_name(name, p), data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    weights = {k: mx.array(v.astype(np.float32)) for k, v in values.items()}
    if hasattr(ref, "sanitize"):  # gemma3_text drops its lm_head when tied
        weights = ref.sanitize(weights)
    ref.load_weights(list(weights.items()), strict=True)
    mx.eval(ref.parameters())
    ref.eval()
    return ref, cfg


def _undo_interleave(w: np.ndarray, n_heads: int) -> np.ndarray:
    out = np.empty_like(w)
    hd = w.shape[0] // n_heads
    for h in range(n_heads):
        for i in range(hd // 2):
            for j in range(2):
                out[h * hd + j * hd // 2 + i] = w[h * hd + 2 * i + j]
    return out


def _write_hparams(w, arch: str, cfg: dict):
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"] if arch in ("qwen2", "phi3") else cfg["head_dim"]
    if arch in ("qwen3", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern(cfg["sliding_window_pattern"])
        w.add_rope_freq_base_swa(cfg.get("rope_local_base_freq", 10000.0))


def _write_tokenizer(w, tok: dict):
    w.add_tokenizer_model(tok["model"])
    w.add_tokenizer_pre(tok.get("pre", "default"))
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    if "scores" in tok:
        w.add_token_scores(tok["scores"])
    if "merges" in tok:
        w.add_token_merges(tok["merges"])
    for role in ("bos", "eos", "unk"):
        if role in tok:
            getattr(w, f"add_{role}_token_id")(tok[role])
    w.add_add_bos_token(tok.get("add_bos", False))
    if "add_space_prefix" in tok:
        w.add_add_space_prefix(tok["add_space_prefix"])


def spm_reference_encode(vocab, text):
    """llama.cpp's SPM algorithm, restated: characters, then repeatedly merge
    the adjacent pair whose concatenation is the best-scoring piece (leftmost
    on ties); pieces not in the vocabulary become <0xXX> byte tokens."""
    ids = {t: i for i, t in enumerate(vocab["tokens"])}
    text = text.replace(" ", SP)
    if vocab["add_space_prefix"]:
        text = SP + text
    syms = list(text)
    while True:
        best = None
        for i in range(len(syms) - 1):
            cand = syms[i] + syms[i + 1]
            j = ids.get(cand)
            if j is not None and vocab["types"][j] == 1:
                if best is None or vocab["scores"][j] > best[0]:
                    best = (vocab["scores"][j], i)
        if best is None:
            break
        i = best[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    out = [vocab["bos"]]
    for s in syms:
        out += [ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()]
    return out
