"""Drop-in quantized layers backed by ``mixbits.qmatmul``.

:class:`MixedQuantizedLinear` is called exactly like ``mlx.nn.QuantizedLinear``
(``layer(x)``, optional bias) but its weight is a mixbits tensor: one or more
K-segments (bits, group size, columns; ``"ternary"`` allowed) and an optional
input permutation. :class:`MixedQuantizedEmbedding` does the same for
``mlx.nn.QuantizedEmbedding``, including ``as_linear`` for tied output heads.

Parameters live in the module tree as MLX arrays, so ``model.parameters()``,
``save_weights`` and ``load_weights`` work. Their names:

- one segment, no permutation: ``weight``, ``scales``, ``biases`` (and
  ``bias``) -- exactly the names and layout of ``nn.QuantizedLinear``, so a
  saved file reads back into stock MLX layers;
- otherwise ``segments.<i>.weight/scales/biases`` and ``perm``.

:func:`patch` swaps every affine quantized layer of a loaded model for these
layers without re-quantizing; :func:`quantize_model` applies a per-tensor
assignment of bits / group size / segments.
"""

from .assignment import TensorSpec, parse_assignment_spec, quantize_model
from .bands import RowBandEmbedding
from .layers import MixedQuantizedEmbedding, MixedQuantizedLinear, MixedQuantizedSwitchLinear, quantize_stack
from .model import (is_expert_stack, patch, quantized_layers, repack_layers, repacked_layers, set_module,
                    unrepack_layers, weight_layers)
from .weight import MixedWeight

__all__ = [
    "MixedQuantizedLinear",
    "MixedQuantizedEmbedding",
    "MixedQuantizedSwitchLinear",
    "RowBandEmbedding",
    "MixedWeight",
    "TensorSpec",
    "is_expert_stack",
    "patch",
    "quantize_model",
    "parse_assignment_spec",
    "quantized_layers",
    "quantize_stack",
    "repack_layers",
    "unrepack_layers",
    "repacked_layers",
    "set_module",
    "weight_layers",
]
