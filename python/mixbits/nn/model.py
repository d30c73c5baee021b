"""Model-level operations on the module tree: find the quantized layers,
swap in mixbits ones (:func:`patch`), repack them, and replace a module by
its dotted path."""

from __future__ import annotations

import mlx.nn as nn

from ..errors import UsageError
from ..repack import REPACK_BITS
from .layers import MixedQuantizedEmbedding, MixedQuantizedLinear, MixedQuantizedSwitchLinear
from .weight import MixedWeight


def _get_child(module, part: str):
    if isinstance(module, list):
        return module[int(part)]
    if isinstance(module, dict):
        return module[part]
    raise KeyError(part)


def _resolve(model: nn.Module, path: str):
    """(parent, last key, module) for a dotted module path; KeyError if absent."""
    parts = path.split(".")
    parent = model
    try:
        for p in parts[:-1]:
            parent = _get_child(parent, p)
        child = _get_child(parent, parts[-1])
    except (KeyError, IndexError, ValueError):
        raise KeyError(path) from None
    return parent, parts[-1], child


def set_module(model: nn.Module, path: str, new) -> None:
    parent, key, _ = _resolve(model, path)
    if isinstance(parent, list):
        parent[int(key)] = new
    else:
        setattr(parent, key, new)


def quantized_layers(model: nn.Module) -> dict:
    """path -> module for every quantized linear/embedding (stock or mixbits)."""
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding, MixedQuantizedLinear, MixedQuantizedEmbedding)
    return {p: m for p, m in model.named_modules() if isinstance(m, kinds)}


LINEAR_KINDS = (nn.Linear, nn.QuantizedLinear, MixedQuantizedLinear)
EMBED_KINDS = (nn.Embedding, nn.QuantizedEmbedding, MixedQuantizedEmbedding)


def mlx_lm_switch_kinds() -> tuple[tuple, tuple]:
    """mlx-lm's ((SwitchLinear,), (QuantizedSwitchLinear,)), or empty
    tuples when mlx-lm (an optional dependency) is absent: then no model
    has such stacks."""
    try:
        from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
    except ImportError:
        return (), ()
    return (SwitchLinear,), (QuantizedSwitchLinear,)


def is_expert_stack(m) -> bool:
    """An expert stack ``layer(x, indices)`` that :class:`MixedQuantizedSwitchLinear`
    replaces: mlx-lm's float ``SwitchLinear``, its ``QuantizedSwitchLinear``,
    or a mixbits one. Other 3-D weights (mlx-lm's MultiLinear heads) are
    not: they are called without indices."""
    floats, quantized = mlx_lm_switch_kinds()
    return isinstance(m, floats + quantized + (MixedQuantizedSwitchLinear,))


def weight_layers(model: nn.Module) -> dict:
    """path -> module for every linear or embedding layer, float or quantized:
    the tensors an assignment can name."""
    return {p: m for p, m in model.named_modules() if isinstance(m, LINEAR_KINDS + EMBED_KINDS)}


_REPACKABLE = (MixedQuantizedLinear, MixedQuantizedEmbedding, MixedQuantizedSwitchLinear)


def repack_layers(model: nn.Module) -> list[str]:
    """Repack (:meth:`MixedQuantizedLinear.repack`) every mixbits linear,
    embedding (a tied head's table) and expert-stack layer of ``model`` whose segments
    all have bits in ``REPACK_BITS``; the others keep MLX's layout and the
    kernels they had. Returns the repacked paths.

    Repacked linear siblings of one module with one input size (q/k/v,
    gate/up) then share a :class:`mixbits.siblings.SiblingGroup`: once the
    model has called the same ones on one input twice, they run as one
    node per call (bit for bit the same outputs)."""
    from ..siblings import install_sibling_groups

    done = []
    for path, m in model.named_modules():
        if isinstance(m, _REPACKABLE) and not m.is_repacked and all(
            bits in REPACK_BITS for bits, _, _ in m.layout.specs
        ):
            m.repack()
            done.append(path)
    install_sibling_groups(model)
    return done


def unrepack_layers(model: nn.Module) -> list[str]:
    """Undo :func:`repack_layers` (bit for bit); returns the paths changed."""
    from ..siblings import remove_sibling_groups

    remove_sibling_groups(model)
    done = []
    for path, m in model.named_modules():
        if isinstance(m, _REPACKABLE) and m.is_repacked:
            m.unrepack()
            done.append(path)
    return done


def repacked_layers(model: nn.Module) -> list[str]:
    """Paths of the layers of ``model`` that hold a repacked weight."""
    return [p for p, m in model.named_modules() if isinstance(m, _REPACKABLE) and m.is_repacked]


def patch(model: nn.Module, *, strict: bool = True, functions: bool = True,
          activations: str = "float", repack: bool = False) -> list[str]:
    """Replace, in place, every ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding``
    and every mlx-lm ``QuantizedSwitchLinear`` (expert stack) of ``model``
    by its mixbits counterpart, sharing the same arrays (no
    re-quantization). Returns the replaced module paths.

    With ``functions=True`` (default) the model's causal attention and
    SwiGLU also run on the mixbits CPU kernels
    (:func:`mixbits.routing.patch_functions`).

    Layers of MLX's other quantization modes (mxfp4, nvfp4, mxfp8) are left
    to MLX's own layers, which run them (mixbits has no kernel for them).
    Affine layers mixbits cannot take over (unsupported bits or group sizes,
    a global scale) raise a ValueError naming the path, or are left as they
    are with ``strict=False``. Nothing is replaced if any layer fails in
    strict mode.

    ``activations`` sets every mixbits linear layer's (and tied head's)
    numeric contract, replaced or already mixbits: ``"float"`` (default),
    ``"int8"``, ``"int16"`` or ``"int8-all"`` (int8 at every M: prompts
    too; see :func:`mixbits.qmatmul`), expert stacks included (on each
    expert's rows: :func:`mixbits.gather_qmatmul`).

    ``repack=True`` (with an integer ``activations``) then
    stores every mixbits linear, embedding and expert-stack layer (all of 2/3/4/5/6/8-bit
    segments) in the row-interleaved layout of the CPU's batch-1 integer GEMV
    (:func:`repack_layers`; layers with other bits keep MLX's layout).
    Such a model cannot be saved or differentiated, nor run on the GPU,
    until :func:`unrepack_layers`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an mlx.nn.Module, got {type(model).__name__}")
    from ..ops import activations_id, repacked_kernels_available

    activations_id(activations)
    if not isinstance(repack, bool):
        raise TypeError(f"repack must be a bool, got {type(repack).__name__}")
    if repack and activations == "float":
        raise UsageError("repack=True is the layout of the integer GEMV: pass activations='int8' or 'int16'")
    if repack and not repacked_kernels_available():
        raise UsageError(
            "repack=True: this CPU has no kernel for the repacked layout (they need AVX2, AVX512-VNNI or arm64 NEON), "
            "so every call would un-repack the weights, slower than MLX's layout; leave repack off")
    _, stock_stacks = mlx_lm_switch_kinds()
    planned = []
    for path, m in model.named_modules():
        if getattr(m, "mode", "affine") != "affine":
            continue  # MLX's layer runs its own mode; nothing here to take over
        try:
            if isinstance(m, nn.QuantizedLinear):
                planned.append((path, MixedQuantizedLinear.from_quantized(m)))
            elif isinstance(m, nn.QuantizedEmbedding):
                planned.append((path, MixedQuantizedEmbedding.from_quantized(m)))
            elif isinstance(m, stock_stacks):
                planned.append((path, MixedQuantizedSwitchLinear.from_quantized(m)))
        except ValueError as e:
            if strict:
                raise ValueError(f"cannot patch {path!r}: {e}") from None
    for path, new in planned:
        set_module(model, path, new)
    for _, m in model.named_modules():
        if isinstance(m, MixedWeight):
            m.activations = activations
    if repack:
        repack_layers(model)
    if functions:
        from ..routing import patch_functions

        patch_functions(model)
    return [p for p, _ in planned]
