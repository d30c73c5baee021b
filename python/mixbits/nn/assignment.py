"""Per-tensor assignments (module path -> bits / group size / segments) and
:func:`quantize_model`, which applies one to a model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import mlx.core as mx
import mlx.nn as nn

from ..layout import DEFAULT_GROUP_SIZE, TERNARY, check_perm
from ..layout import quantize as _quantize
from .bands import RowBandEmbedding
from .layers import MixedQuantizedEmbedding, MixedQuantizedLinear, MixedQuantizedSwitchLinear, quantize_stack
from .model import EMBED_KINDS, LINEAR_KINDS, is_expert_stack, mlx_lm_switch_kinds, set_module
from .weight import MixedWeight, normalize_specs


@dataclass(frozen=True)
class TensorSpec:
    """One assignment entry, normalized: segments with original-order
    columns counted after ``perm``."""

    segments: tuple  # ((bits | "ternary", group_size, k), ...) ; k may be None = all of K
    perm: object = None

    def resolve(self, K: int):
        segs = [(b, g, K if k is None else k) for b, g, k in self.segments]
        return segs


def parse_assignment_spec(spec, path: str = "?") -> TensorSpec:
    """Accepted forms of one assignment value:

    - ``4`` (bits; group size 64), ``"ternary"``;
    - ``(bits, group_size)`` or ``{"bits": b, "group_size": g}`` (bits may be
      ``"ternary"``);
    - ``[(bits, group_size, k), ...]`` within-tensor segments;
    - ``{"segments": [...], "perm": array-or-None}``.
    """
    where = f"assignment[{path!r}]"
    if isinstance(spec, TensorSpec):
        return spec
    if isinstance(spec, bool):
        raise ValueError(f"{where}: expected bits, (bits, group_size), or segments, got {spec!r}")
    if isinstance(spec, int) or spec == TERNARY:
        return TensorSpec(((spec, DEFAULT_GROUP_SIZE, None),))
    if isinstance(spec, Mapping):
        if "segments" in spec:
            return TensorSpec(_segment_list(spec["segments"], where), spec.get("perm"))
        if "bits" not in spec:
            raise ValueError(f"{where}: a dict needs 'bits' (and optional 'group_size') or 'segments'")
        return TensorSpec(((spec["bits"], spec.get("group_size", DEFAULT_GROUP_SIZE), None),))
    if isinstance(spec, (list, tuple)):
        if len(spec) == 2 and not isinstance(spec[0], (list, tuple)):
            return TensorSpec(((spec[0], spec[1], None),))
        return TensorSpec(_segment_list(spec, where))
    raise ValueError(f"{where}: expected bits, (bits, group_size), or segments, got {spec!r}")


def _segment_list(segs, where: str) -> tuple:
    out = []
    for i, s in enumerate(segs):
        if not isinstance(s, (list, tuple)) or len(s) != 3:
            raise ValueError(f"{where}: segment {i} must be (bits, group_size, k_columns), got {s!r}")
        out.append(tuple(s))
    if not out:
        raise ValueError(f"{where}: segments list is empty")
    return tuple(out)


def _float_weight(m) -> mx.array:
    """The dense weight of a (possibly quantized) linear, embedding or
    expert stack, original column order."""
    if isinstance(m, RowBandEmbedding):
        return m.dense_weight()
    if isinstance(m, MixedWeight):
        return m.quantized_tensor().dequantize(unpermute=True)
    if "scales" in m:  # a stock quantized layer (QuantizedLinear/Embedding/SwitchLinear)
        return mx.dequantize(
            m["weight"], m["scales"], m.get("biases"), group_size=m.group_size, bits=m.bits,
            mode=getattr(m, "mode", "affine"), global_scale=m.get("global_scale"),
        )
    return m.weight


def quantize_model(model: nn.Module, assignment: Mapping, *, dtype=None) -> list[str]:
    """Quantize the tensors named in ``assignment`` (module path -> spec,
    see :func:`parse_assignment_spec`) in place; other modules are left as
    they are. Linear layers become :class:`MixedQuantizedLinear`, embeddings
    :class:`MixedQuantizedEmbedding`, expert stacks (mlx-lm's
    ``SwitchLinear`` / ``QuantizedSwitchLinear``, or mixbits ones)
    :class:`MixedQuantizedSwitchLinear` with the same segments and
    permutation for every expert. Already-quantized layers are dequantized
    first. Scales/biases take ``dtype`` (default: the source scales' dtype
    for quantized layers, the weight dtype for float ones).

    Every entry is validated (path exists, module kind, segment columns sum
    to K, group sizes divide, permutation) and every new layer built before
    any module is changed. Returns the replaced paths.
    """
    from ..adapter import weight_shape

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an mlx.nn.Module, got {type(model).__name__}")
    if not isinstance(assignment, Mapping):
        raise TypeError(f"assignment must be a mapping of module path -> spec, got {type(assignment).__name__}")
    modules = dict(model.named_modules())
    kinds = (LINEAR_KINDS + EMBED_KINDS + sum(mlx_lm_switch_kinds(), ())
             + (MixedQuantizedSwitchLinear, RowBandEmbedding))
    unknown = [p for p in assignment if p not in modules]
    if unknown:
        known = [p for p, m in modules.items() if isinstance(m, kinds)]
        raise KeyError(
            f"assignment names {len(unknown)} path(s) not in the model: {unknown[:5]}"
            + (" ..." if len(unknown) > 5 else "")
            + f"; quantizable paths look like {known[:3]}"
        )
    plan = []
    for path, raw in assignment.items():
        m = modules[path]
        if not isinstance(m, kinds):
            raise TypeError(
                f"assignment[{path!r}]: module is {type(m).__name__}, not a linear, embedding "
                "or expert-stack (SwitchLinear) layer"
            )
        spec = parse_assignment_spec(raw, path)
        w_shape = weight_shape(m)
        segs = spec.resolve(w_shape[-1])
        try:
            normalize_specs(segs, w_shape[-1])
            perm = None if spec.perm is None else check_perm(spec.perm, w_shape[-1])
        except ValueError as e:
            raise ValueError(f"assignment[{path!r}]: {e} (weight shape {w_shape})") from None
        plan.append((path, m, segs, perm))
    # All layers are built before the first swap: a failure while
    # quantizing (e.g. a source layer that cannot be dequantized) leaves
    # the model as it was.
    built = []
    for path, m, segs, perm in plan:
        w = _float_weight(m)
        if dtype is not None:
            dt = dtype
        elif isinstance(m, (MixedWeight, RowBandEmbedding)):
            dt = (m.bands[0] if isinstance(m, RowBandEmbedding) else m).quantized_tensor().dtype
        elif "scales" in m:
            dt = m["scales"].dtype
        else:
            dt = w.dtype
        _, seg_kinds = normalize_specs(segs)
        if is_expert_stack(m):
            new = MixedQuantizedSwitchLinear.from_tensor(quantize_stack(w, segs, perm, dt), m.get("bias"), seg_kinds)
        elif isinstance(m, LINEAR_KINDS):
            new = MixedQuantizedLinear.from_tensor(_quantize(w, segs, perm=perm, dtype=dt), m.get("bias"), seg_kinds)
        else:
            new = MixedQuantizedEmbedding.from_tensor(_quantize(w, segs, perm=perm, dtype=dt), seg_kinds)
        mx.eval(new.parameters())
        built.append((path, new))
    for path, new in built:
        set_module(model, path, new)
    return [p for p, _ in built]
