"""A view of an mlx-lm style decoder (``model.model.embed_tokens``,
``.layers``, ``.norm``, and ``lm_head`` or tied embeddings) as a stack of
layers whose linear tensors can be swapped one at a time."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class Site:
    """One quantizable linear tensor: ``model.layers.{layer}.{name}``."""

    path: str
    layer: int
    name: str  # path inside the layer, e.g. "self_attn.q_proj"
    shape: tuple[int, int]  # (N outputs, K inputs)

    @property
    def nparams(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def kind(self) -> str:
        return self.name.rsplit(".", 1)[-1]


def _linear_types():
    from ..nn import MixedQuantizedLinear

    return (nn.Linear, nn.QuantizedLinear, MixedQuantizedLinear)


def dense_weight(module) -> mx.array:
    """The float32 [N, K] weight of a linear layer, whatever its storage."""
    from ..nn import MixedQuantizedLinear

    if isinstance(module, MixedQuantizedLinear):
        return module.quantized_tensor().dequantize(unpermute=True).astype(mx.float32)
    if isinstance(module, nn.QuantizedLinear):
        if getattr(module, "mode", "affine") != "affine":
            raise ValueError(f"only affine quantized layers can be re-quantized, got mode {module.mode!r}")
        return mx.dequantize(
            module.weight, module.scales, module.biases,
            group_size=module.group_size, bits=module.bits,
        ).astype(mx.float32)
    if isinstance(module, nn.Linear):
        return module.weight.astype(mx.float32)
    raise TypeError(f"not a linear layer: {type(module).__name__}")


class LayeredModel:
    def __init__(self, model: nn.Module):
        inner = getattr(model, "model", None)
        for attr in ("embed_tokens", "layers", "norm"):
            if inner is None or not hasattr(inner, attr):
                raise TypeError(
                    "expected an mlx-lm style model with model.model.embed_tokens, "
                    f".layers and .norm; missing {attr!r}"
                )
        self.model = model
        self.inner = inner
        self.layers = inner.layers

    # ------------------------------------------------------------- forward

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens)

    def run_layers(self, h: mx.array, start: int, stop: int | None = None) -> mx.array:
        mask = "causal" if h.shape[1] > 1 else None
        for layer in self.layers[start:stop]:
            h = layer(h, mask, cache=None)
        return h

    def head(self, h: mx.array) -> mx.array:
        out = self.inner.norm(h)
        if getattr(self.model, "lm_head", None) is not None:
            return self.model.lm_head(out)
        return self.inner.embed_tokens.as_linear(out)

    def logits(self, tokens: mx.array) -> mx.array:
        return self.head(self.run_layers(self.embed(tokens), 0))

    # --------------------------------------------------------------- sites

    def sites(self) -> list[Site]:
        out = []
        types = _linear_types()
        for i, layer in enumerate(self.layers):
            found = [(name, mod) for name, mod in layer.named_modules()
                     if name and isinstance(mod, types)]
            for name, mod in sorted(found, key=lambda nm: _site_order(nm[0])):
                n, k = dense_weight_shape(mod)
                out.append(Site(f"model.layers.{i}.{name}", i, name, (n, k)))
        return out

    def get(self, site: Site):
        mod = self.layers[site.layer]
        for part in site.name.split("."):
            mod = mod[int(part)] if isinstance(mod, list) else getattr(mod, part)
        return mod

    def set(self, site: Site, module) -> None:
        parent = self.layers[site.layer]
        *head, last = site.name.split(".")
        for part in head:
            parent = parent[int(part)] if isinstance(parent, list) else getattr(parent, part)
        if isinstance(parent, list):
            parent[int(last)] = module
        else:
            setattr(parent, last, module)


_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _site_order(name: str):
    """Data-flow order inside a decoder layer; unknown names after, sorted."""
    last = name.rsplit(".", 1)[-1]
    return (_ORDER.index(last) if last in _ORDER else len(_ORDER), name)


def dense_weight_shape(module) -> tuple[int, int]:
    from ..nn import MixedQuantizedLinear

    if isinstance(module, MixedQuantizedLinear):
        return tuple(module.quantized_tensor().shape)
    if isinstance(module, nn.QuantizedLinear):
        n, words = module.weight.shape
        return (n, words * 32 // module.bits)
    return tuple(module.weight.shape)
