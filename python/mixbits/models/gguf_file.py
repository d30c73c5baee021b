"""A small, fast reader of GGUF files: metadata as plain Python values and
each tensor's raw bytes as a read-only memory map.

gguf-py's ``GGUFReader`` builds a numpy view per part of every metadata
value; on a 262,144-token vocabulary that takes ~25 s, so the header is
parsed here with ``struct`` (strings) and ``np.frombuffer`` (numeric
arrays) instead. Block sizes and type names come from gguf-py's tables,
and decoding of tensor blocks is left to :mod:`.gguf_tensors`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import FormatError

# GGUF metadata value types (file-format spec): id -> numpy scalar dtype.
_NUMERIC = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
            10: "<u8", 11: "<i8", 12: "<f8"}
_BOOL, _STRING, _ARRAY = 7, 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple  # numpy (row-major) order: GGUF's ne reversed
    type_id: int  # ggml type (gguf.GGMLQuantizationType value)
    raw: np.ndarray  # uint8 [rows, bytes per row] (or flat for 1-D), memory-mapped

    @property
    def type_name(self) -> str:
        import gguf

        try:
            return gguf.GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type {self.type_id}"


class _Cursor:
    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise FormatError(f"{self.path}: truncated GGUF header")
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v[0] if len(v) == 1 else v

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise FormatError(f"{self.path}: truncated GGUF string")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.take("<I"), self.take("<Q")
            if etype == _STRING:
                return [self.string() for _ in range(n)]
            if etype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(n)]
            if etype not in _NUMERIC:
                raise FormatError(f"{self.path}: unknown GGUF array element type {etype}")
            dt = np.dtype(_NUMERIC[etype])
            end = self.pos + n * dt.itemsize
            if end > len(self.buf):
                raise FormatError(f"{self.path}: truncated GGUF array")
            arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
            self.pos = end
            return [bool(x) for x in arr] if etype == _BOOL else arr.tolist()
        if vtype not in _NUMERIC:
            raise FormatError(f"{self.path}: unknown GGUF value type {vtype}")
        v = np.frombuffer(self.buf, dtype=np.dtype(_NUMERIC[vtype]), count=1, offset=self.pos)[0]
        self.pos += v.itemsize
        return bool(v) if vtype == _BOOL else v.item()


def read(path) -> tuple[dict, dict]:
    """(metadata, tensors) of a GGUF file; tensors maps name -> :class:`TensorInfo`."""
    import gguf

    path = Path(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(mm, path)
    if bytes(mm[:4]) != b"GGUF":
        raise FormatError(f"{path}: not a GGUF file (magic {bytes(mm[:4])!r})")
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise FormatError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    meta = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        ne = [cur.take("<Q") for _ in range(cur.take("<I"))]
        infos.append((name, ne, cur.take("<I"), cur.take("<Q")))
    align = int(meta.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    tensors = {}
    for name, ne, type_id, offset in infos:
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
        except (ValueError, KeyError):
            raise FormatError(f"{path}: tensor {name!r} has unknown ggml type {type_id}") from None
        if not ne or ne[0] % block:
            raise FormatError(f"{path}: tensor {name!r} shape {ne} does not fit {block}-element blocks")
        row_bytes = ne[0] // block * type_size
        rows = int(np.prod(ne[1:], dtype=np.int64)) if len(ne) > 1 else 1
        begin = start + offset
        if begin + rows * row_bytes > len(mm):
            raise FormatError(f"{path}: tensor {name!r} runs past the end of the file")
        raw = mm[begin:begin + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = TensorInfo(name, tuple(int(d) for d in reversed(ne)), type_id, raw)
    return meta, tensors
