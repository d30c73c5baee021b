"""Validation of a ``.safetensors`` file's header before MLX reads it.

MLX's loader trusts the header: a duplicated tensor name or overlapping
data offsets load without complaint and the model computes garbage. This
checks what the format requires (and what the ``safetensors`` package
checks): an 8-byte little-endian header length inside the file, a UTF-8
JSON object without repeated keys, known dtypes, non-negative integer
shapes, and data offsets that match each tensor's byte size and tile the
data area exactly -- in order, no gaps, no overlaps, nothing past the end.
Only the header is read.
"""

from __future__ import annotations

import json
import math
import os
import struct

from .errors import FormatError

# Item sizes of the dtypes safetensors defines (MLX reads a subset).
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}
MAX_HEADER = 100 * 1024 * 1024  # the safetensors package's own limit


def _no_duplicates(pairs):
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise FormatError(f"key {k!r} appears twice")
        seen[k] = v
    return seen


def read_header(path) -> dict:
    """The validated header of ``path``: ``{name: {"dtype", "shape",
    "data_offsets"}}`` (``__metadata__`` dropped). Raises FormatError."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FormatError(f"{path}: {size} bytes is too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise FormatError(f"{path}: header length {n} does not fit in the file ({size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: header is not UTF-8 ({e.reason} at byte {e.start})") from None
    except FormatError as e:
        raise FormatError(f"{path}: header: {e}") from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise FormatError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header must be a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise FormatError(f"{path}: __metadata__ must map strings to strings")
    spans = []
    for name, t in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(t, dict) or set(t) != {"dtype", "shape", "data_offsets"}:
            raise FormatError(f"{where}: expected exactly dtype, shape and data_offsets")
        dtype, shape, offs = t["dtype"], t["shape"], t["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise FormatError(f"{where}: unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise FormatError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int and o >= 0 for o in offs)):
            raise FormatError(f"{where}: data_offsets must be two non-negative integers, got {offs!r}")
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        if offs[1] - offs[0] != nbytes:
            raise FormatError(f"{where}: data_offsets {offs} hold {offs[1] - offs[0]} bytes, "
                              f"but {dtype} {shape} needs {nbytes}")
        spans.append((offs[0], offs[1], name))
    data = size - 8 - n
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else f"leaves a gap at byte {end}"
            raise FormatError(f"{path}: tensor {name!r} (data_offsets [{begin}, {stop}]) {what}")
        end = stop
    if end != data:
        raise FormatError(f"{path}: tensors cover {end} bytes of data but the file has {data}")
    return header
