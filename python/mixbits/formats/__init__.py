"""Readers and writers for the formats of the field: ExLlamaV2
measurement.json, allocation.json, mlx-lm config.json quantization blocks and
mixbits' per-tensor sensitivity tables. Malformed input raises
:class:`FormatError` (a ValueError) naming the offending key path."""

from .allocation import Allocation, AllocationEntry
from .errors import FormatError
from .exl2 import Measurement, Option, ProjectionQuant, projection_shapes
from .mlx_config import MlxQuantization, read_config, with_quantization, write_config
from .sensitivity import Candidate, SensitivityEntry, SensitivityTable, is_sensitivity_table

__all__ = [
    "Allocation", "AllocationEntry", "Candidate", "FormatError", "Measurement",
    "MlxQuantization", "Option", "ProjectionQuant", "SensitivityEntry",
    "SensitivityTable", "is_sensitivity_table", "projection_shapes",
    "read_config", "with_quantization", "write_config",
]
