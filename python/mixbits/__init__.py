"""mixbits: mixed-precision quantized matmul, KL and bit allocation for MLX."""

import mlx.core as _mx  # noqa: F401  (registers mlx's array type for _ext)

from ._backends import check_isa_limit as _check_isa_limit

_check_isa_limit()  # before the extension resolves the CPU's instruction sets

from .layout import QuantizedTensor, quantize
from .ops import gather_qmatmul, gather_quantized_matmul, qmatmul, quantized_matmul
from .kl import kl_divergence
from . import nn
from .nn import patch, quantize_model
from .io import load, save

__all__ = ["QuantizedTensor", "quantize", "qmatmul", "quantized_matmul", "gather_qmatmul",
           "gather_quantized_matmul", "kl_divergence",
           "nn", "patch", "quantize_model", "load", "save"]
__version__ = "0.1.0"
