"""One place that knows a model's structure, found from the model itself.

mlx-lm models expose their decoder blocks as ``model.layers`` (wrappers
such as VLMs forward it to ``language_model``) and mark every quantizable
leaf module by a ``to_quantized`` method; a model may also carry a
``quant_predicate`` deciding per path what mlx-lm quantizes and how. The
adapter reads exactly that, so every consumer (sweep, ExLlamaV2 grouping,
recipes, routing, quantize, save) sees the same tensors under the same
real module paths (``language_model.model.layers.0.linear_attn.in_proj_qkv``)
and nothing else names projections.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

__all__ = ["ModelAdapter", "Site", "dense_weight", "get_module", "quantized_form", "set_module",
           "weight_shape", "weighted_weight_error"]


@dataclass(frozen=True)
class Site:
    """One quantizable tensor of a model."""

    path: str  # real module path
    block: int | None  # index of the decoder block holding it, None outside blocks
    shape: tuple  # dense weight shape: (N, K), or (E, N, K) for stacks
    form: str  # "linear", "embedding" or "stack" (expert stacks, multi-head linears)
    # An expert stack called with expert indices (mlx-lm's SwitchLinear and
    # its quantized forms): mixbits has a mixed-segment layer for it
    # (MixedQuantizedSwitchLinear); other stacks keep MLX's single segment.
    experts: bool = False
    # The class name of a linear whose own __call__ post-processes the
    # product (afm7's FusedLinear splits it into q, k, v): no mixbits layer
    # can stand in for it, so no candidate fits and it stays float.
    own_call: str | None = None

    @property
    def nparams(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def layer(self) -> int | None:
        return self.block

    @property
    def name(self) -> str:
        """The last path component (``q_proj``, ``down_proj``, ``lm_head``)."""
        return self.path.rsplit(".", 1)[-1]

    @property
    def kind(self) -> str:  # kept for older callers
        return self.name

    @property
    def k(self) -> int:
        return int(self.shape[-1])


def _mixbits_kinds():
    from .nn import MixedQuantizedEmbedding, MixedQuantizedLinear, MixedQuantizedSwitchLinear

    return MixedQuantizedLinear, MixedQuantizedEmbedding, MixedQuantizedSwitchLinear


def _banded(m) -> bool:
    """A mixbits embedding stored in row bands: one tensor, several QuantizedTensors."""
    from .nn import RowBandEmbedding

    return isinstance(m, RowBandEmbedding)


def _is_quantizable(m) -> bool:
    """mlx-lm's rule: a module that can turn itself quantized, or one that
    already is (stock or mixbits)."""
    if isinstance(m, _mixbits_kinds()) or _banded(m):
        return True
    if "weight" not in m or not isinstance(m["weight"], mx.array):
        return False
    if "scales" in m:  # a stock quantized module: it knows its bits
        return isinstance(getattr(m, "bits", None), int)
    return hasattr(m, "to_quantized")


def _own_call(m) -> str | None:
    """The class name of a linear subclass with its own ``__call__``, else None.
    A class mixbits.routing gave the module (``_mixbits_routes``: the class
    whose product it computes, on other kernels) counts as that class."""
    if isinstance(m, _mixbits_kinds()):
        return None
    cls = getattr(type(m), "_mixbits_routes", type(m))
    for base in (nn.QuantizedLinear, nn.Linear):
        if isinstance(m, base) and cls.__call__ is not base.__call__:
            return cls.__name__
    return None


def _form(m) -> str:
    lin, emb, switch = _mixbits_kinds()
    if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding, emb)) or _banded(m):
        return "embedding"
    if isinstance(m, (nn.Linear, nn.QuantizedLinear, lin)):
        return "linear"
    if isinstance(m, switch):
        return "stack"
    return "stack" if m["weight"].ndim == 3 else "linear"


def weight_shape(m) -> tuple:
    """Dense weight shape of a quantizable module, whatever its storage."""
    if _banded(m):
        return (m.num_embeddings, m.dims)
    if isinstance(m, _mixbits_kinds()):
        qt = m.quantized_tensor()
        return (*qt.batch_shape, *qt.shape)
    w = m["weight"]
    if "scales" in m:
        bits = getattr(m, "bits", None)
        if not isinstance(bits, int):
            raise ValueError(f"{type(m).__name__}: quantized without an integer 'bits'")
        return (*w.shape[:-1], w.shape[-1] * 32 // bits)
    return tuple(w.shape)


def quantized_form(m):
    """The weight of a quantized module as a :class:`~mixbits.layout.QuantizedTensor`
    (a mixbits layer's own; a stock affine layer's arrays as one segment),
    or None for a float module. A row-banded embedding has one tensor per
    band, not one: ValueError, as for a layer that cannot be re-quantized
    from its codes (callers decode it with :func:`dense_weight`)."""
    from .layout import QuantizedTensor, Segment

    if _banded(m):
        raise ValueError("a row-banded embedding has one quantized tensor per band")
    if isinstance(m, _mixbits_kinds()):
        return m.quantized_tensor()
    if "scales" not in m:
        return None
    mode = getattr(m, "mode", "affine")
    if mode != "affine":
        raise ValueError(f"only affine quantized layers can be re-quantized, got mode {mode!r}")
    if m.get("biases") is None:
        raise ValueError(f"{type(m).__name__}: affine quantized without biases")
    w = m["weight"]
    return QuantizedTensor([Segment(m.bits, m.group_size, w.shape[-1] * 32 // m.bits, w,
                                    m["scales"], m["biases"])])


def _fp_mode_weight(m):
    """The float32 weight of a stock layer in one of MLX's fp modes (mxfp4,
    nvfp4, mxfp8: no affine segments), decoded by ``mx.dequantize`` (exact
    in float32: a 2- or 4-bit mantissa times an 8-bit scale); None for any
    other module."""
    if "scales" not in m or getattr(m, "mode", "affine") == "affine":
        return None
    return mx.dequantize(m["weight"], m["scales"], m.get("biases"), group_size=m.group_size,
                         bits=m.bits, mode=m.mode, global_scale=m.get("global_scale"),
                         dtype=mx.float32)


def dense_weight(m) -> mx.array:
    """The float32 dense weight of a quantizable module (original column
    order); quantized ones as ``s*q + b`` in float32 (scales widened first),
    MLX's fp modes as ``mx.dequantize`` decodes them."""
    if _banded(m):
        return m.dense_weight()
    fp = _fp_mode_weight(m)
    if fp is not None:
        return fp
    qt = quantized_form(m)
    if qt is None:
        return m["weight"].astype(mx.float32)
    return qt.dequantize(unpermute=True, dtype=mx.float32)


def weighted_weight_error(m, w: mx.array, weight: mx.array) -> float:
    """sum(weight * (dense_weight(m) - w)**2) as a Python float; for a
    quantized module in one pass over its codes (no dense copy), see
    :meth:`~mixbits.layout.QuantizedTensor.weighted_error`."""
    if _banded(m):
        return m.weighted_error(w, weight)
    qt = None if _fp_mode_weight(m) is not None else quantized_form(m)
    if qt is not None:
        return qt.weighted_error(w, weight)
    d = dense_weight(m) - w
    return (weight.astype(mx.float32) * d * d).astype(mx.float32).sum().item()


def _fixed_spec(rule: dict) -> dict:
    """{"bits", "group_size"} of a quant_predicate's dict as ``nn.quantize``
    applies it: ``to_quantized(**rule)``, a missing key taking MLX's default
    for the mode (rwkv7 pins layers with ``{"bits": 8}``: group size 64)."""
    try:
        from mlx.nn.layers.quantized import _defaults_for_mode
    except ImportError:  # private in MLX; its affine defaults are these
        def _defaults_for_mode(mode, group_size, bits):
            return group_size or 64, bits or 4
    gs, bits = _defaults_for_mode(rule.get("mode", "affine"), rule.get("group_size"), rule.get("bits"))
    return {"bits": int(bits), "group_size": int(gs)}


def _child(parent, key: str):
    return parent[int(key)] if isinstance(parent, list) else parent[key]


class ModelAdapter:
    """Structure of one model: its decoder blocks, its quantizable tensors
    and the tensors the model's own ``quant_predicate`` fixes.

    ``blocks`` is the list object the model iterates (``model.layers``);
    ``block_prefix`` its module path. A model without ``layers`` still has
    tensors; it just cannot be replayed block by block.
    """

    def __init__(self, model: nn.Module):
        from .nn import is_expert_stack

        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an mlx.nn.Module, got {type(model).__name__}")
        self.model = model
        self.blocks = self._find_blocks(model)
        modules = dict(model.named_modules())
        self.block_prefix = None
        if self.blocks:
            ids = {id(m): p for p, m in modules.items()}
            first = ids.get(id(self.blocks[0]))
            if first is not None and first.rsplit(".", 1)[-1] == "0":
                self.block_prefix = first.rsplit(".", 1)[0]
                # ``model.layers`` may be a fresh slice (mlx-lm's pipeline
                # mixin); the stored list is what the forward iterates.
                self.blocks = get_module(model, self.block_prefix)
            else:
                self.blocks = []
        predicate = getattr(model, "quant_predicate", None)
        self.sites: list[Site] = []
        self.fixed: dict[str, dict] = {}  # path -> {"bits", "group_size"} set by the model
        # quantizable, but kept float: the model says so, or pins a group
        # size that does not divide the tensor's width
        self.excluded: list[str] = []
        inside = ()  # paths of quantizable modules: their children are storage, not tensors
        for path, m in modules.items():
            if not path or path.startswith(inside) or not _is_quantizable(m):
                continue
            inside = (*inside, path + ".")
            rule = predicate(path, m) if callable(predicate) else True
            if rule is False:
                self.excluded.append(path)
                continue
            if isinstance(rule, dict):
                spec = _fixed_spec(rule)
                if weight_shape(m)[-1] % spec["group_size"]:
                    # Not quantizable so (mx.quantize refuses); mlx-lm's
                    # convert, at its default group size, leaves such a
                    # layer float before asking the model.
                    self.excluded.append(path)
                else:
                    self.fixed[path] = spec
                continue
            self.sites.append(Site(path, self.block_of(path), weight_shape(m), _form(m),
                                   experts=is_expert_stack(m), own_call=_own_call(m)))
        # Data-flow order: embeddings, blocks (children in the order the
        # block defines them: attention before MLP), then heads.
        self.sites.sort(key=self._order)
        self._by_path = {s.path: s for s in self.sites}

    def _order(self, s: Site):
        if s.block is None:
            return (-1 if s.form == "embedding" else 1 << 30, 0, s.path)
        children = list(self.blocks[s.block].keys())
        first = s.path[len(f"{self.block_prefix}.{s.block}.") :].split(".", 1)[0]
        return (s.block, children.index(first) if first in children else len(children), s.path)

    @staticmethod
    def _find_blocks(model) -> list:
        try:
            layers = model.layers
        except AttributeError:
            return []
        if isinstance(layers, list) and layers and all(isinstance(b, nn.Module) for b in layers):
            return layers
        return []

    # ------------------------------------------------------------ questions

    def block_of(self, path: str) -> int | None:
        if self.block_prefix is None or not path.startswith(self.block_prefix + "."):
            return None
        return int(path[len(self.block_prefix) + 1 :].split(".", 1)[0])

    def site(self, path: str) -> Site:
        try:
            return self._by_path[path]
        except KeyError:
            raise KeyError(f"{path!r} is not a quantizable tensor of this model; "
                           f"e.g. {[s.path for s in self.sites[:3]]}") from None

    def group_of(self, site: Site) -> str | None:
        """The ExLlamaV2-style module holding ``site``: the block's direct
        child (``...layers.3.self_attn``, ``...layers.3.mlp``,
        ``...layers.3.linear_attn``), None outside blocks."""
        if site.block is None:
            return None
        head = f"{self.block_prefix}.{site.block}."
        first = site.path[len(head):].split(".", 1)[0]
        return head + first

    def groups(self) -> dict[str, list[Site]]:
        out: dict[str, list[Site]] = {}
        for s in self.sites:
            g = self.group_of(s)
            if g is not None:
                out.setdefault(g, []).append(s)
        return out

    def role(self, site: Site) -> str:
        """What a recipe needs to know of a tensor: "values" (attention
        value projection), "down" (the MLP's output projection), "head",
        "embedding", or "other". Names follow mlx-lm's conventions."""
        if site.form == "embedding":
            return "embedding"
        if site.block is None:
            return "head"
        if site.name in ("v_proj", "wv", "value"):
            return "values"
        if site.name in ("down_proj", "w2", "fc2", "c_proj") and ".mlp" in site.path:
            return "down"
        return "other"

    # ------------------------------------------------------------ modules

    def get(self, path: str):
        return get_module(self.model, path)

    def set(self, path: str, module) -> None:
        set_module(self.model, path, module)

    def local_path(self, site: Site) -> str:
        """``site``'s path inside its block (``self_attn.q_proj``)."""
        return site.path[len(f"{self.block_prefix}.{site.block}.") :]


def get_module(root, path: str):
    mod = root
    for part in path.split("."):
        mod = _child(mod, part)
    return mod


def set_module(root, path: str, module) -> None:
    *head, last = path.split(".")
    parent = get_module(root, ".".join(head)) if head else root
    if isinstance(parent, list):
        parent[int(last)] = module
    else:
        setattr(parent, last, module)
