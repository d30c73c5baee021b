"""Build an mlx-lm model from a GGUF file (llama, qwen2, qwen3, gemma3,
phi3; see :mod:`.gguf_arch`), keeping quantized weights where MLX can
hold them exactly.

Tensors in Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 become ``nn.QuantizedLinear`` /
``nn.QuantizedEmbedding`` layers with group size 32 and the same values
(see :mod:`.gguf_tensors`); every other type gguf-py can decode (K-quants,
IQ types, BF16...) becomes a dense float32 layer with gguf-py's decoded
values. The model itself is mlx-lm's class for the architecture, so any
folder we save is a normal mlx-lm model.

Rotary embedding order (llama only): llama.cpp's converter permutes the
rows of the q and k projections of each head from HF's half-split order
into interleaved pairs. We undo that row permutation (rows are whole
quantization groups, so it is exact on the quantized storage) and use
mlx-lm's default, non-traditional rope.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import FormatError
from . import gguf_arch, gguf_file
from .gguf_arch import UnsupportedArchitecture
from .gguf_tensors import to_mlx
from .tokenizer import Tokenizer

__all__ = ["UnsupportedArchitecture", "load_gguf", "read_weights", "unpermute_rope_rows"]


def unpermute_rope_rows(a: mx.array, n_heads: int) -> mx.array:
    """Inverse of llama.cpp's q/k row permutation: interleaved pairs back to
    HF's half-split order. ``a`` is any per-row array (weight codes, scales,
    biases) with n_heads * head_dim rows."""
    rows = a.shape[0]
    head_dim = rows // n_heads
    rest = a.shape[1:]
    return a.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def read_weights(path, *, undo_rope_permutation: bool = True, dense_dtype=None):
    """(weights, bits, config, metadata): mlx-lm parameter name -> array,
    quantized module path -> bits, the mlx-lm config. Raises
    :class:`UnsupportedArchitecture` before decoding any tensor."""
    meta, infos = gguf_file.read(path)
    arch = gguf_arch.check_supported(meta)
    cfg = gguf_arch.config(arch, meta, infos)
    names = {name: gguf_arch.mlx_name(arch, name) for name in infos}  # unknown tensors fail here
    permuted = {}
    if gguf_arch.rope_permuted(arch):
        if undo_rope_permutation:
            for i in range(cfg["num_hidden_layers"]):
                permuted[f"model.layers.{i}.self_attn.q_proj"] = cfg["num_attention_heads"]
                permuted[f"model.layers.{i}.self_attn.k_proj"] = cfg["num_key_value_heads"]
        else:
            cfg["rope_traditional"] = True
    weights, bits = {}, {}
    for name, t in infos.items():
        target = names[name]
        module, _, leaf = target.rpartition(".")
        parts = to_mlx(t, dense_dtype)
        if "bits" in parts:
            if leaf != "weight":
                raise FormatError(f"GGUF tensor {name!r} is quantized but is not a weight")
            bits[module] = parts.pop("bits")
            arrays = {f"{module}.{k}": v for k, v in parts.items()}
        else:
            w = parts["weight"]
            shift = gguf_arch.norm_shift(arch, target)
            arrays = {target: w + shift if shift else w}
        if module in permuted:
            arrays = {k: unpermute_rope_rows(v, permuted[module]) for k, v in arrays.items()}
        weights.update(arrays)
    return weights, bits, cfg, meta


def _build(cfg: dict, weights: dict, bits: dict):
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)  # ties lm_head where the file has no output.weight
    per_path = {}

    def predicate(p, m):
        if p not in bits:
            return False
        per_path[p] = {"group_size": 32, "bits": bits[p], "mode": "affine"}
        return per_path[p]

    nn.quantize(model, class_predicate=predicate)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    if per_path:
        counts = {}
        for q in per_path.values():
            counts[q["bits"]] = counts.get(q["bits"], 0) + 1
        quant = {"group_size": 32, "bits": max(counts, key=counts.get), "mode": "affine"}
        quant.update({p: {"group_size": q["group_size"], "bits": q["bits"]} for p, q in per_path.items()})
        cfg["quantization"] = quant
        cfg["quantization_config"] = dict(quant)
    return model


def load_gguf(path, *, undo_rope_permutation: bool = True, dense_dtype=None):
    """(model, tokenizer, config) from a GGUF file.

    ``config`` is what a saved folder's config.json holds, including the
    mlx-lm ``quantization`` dict with one entry per quantized module.
    With ``undo_rope_permutation=False`` a llama model keeps q/k rows in
    GGUF order and uses traditional (interleaved) rope instead; both give
    the same outputs. ``dense_dtype`` casts tensors decoded densely (float32
    by default, exact).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    weights, bits, cfg, meta = read_weights(path, undo_rope_permutation=undo_rope_permutation,
                                            dense_dtype=dense_dtype)
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    model = _build(cfg, weights, bits)
    return model, tokenizer, cfg
