"""GGUF tensor blocks -> MLX arrays.

Block formats whose value is exactly ``scale * code + bias`` per group of
32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) become MLX affine triplets (uint32
codes, fp16 scales and biases) without any rounding: a Q8_0 value d*q is
code q+128 with scale d and bias -128*d; Q4_0 d*(q-8) is scale d, bias
-8*d; Q5_0 d*(q-16) is scale d, bias -16*d; the _1 variants store
scale d and bias m directly. The fp16 products -8d, -16d, -128d are
exact (powers of two) unless they overflow, in which case the tensor is
decoded densely instead.

Every other type gguf-py can decode (F16, BF16, K-quants, IQ types, ...)
becomes a dense float array through ``gguf.quants.dequantize`` (float32:
exactly the values llama.cpp's reference decoder gives), since K-quant
sub-block scales (6-bit integer x fp16 super-scale) have no fp16 affine
equivalent.

Non-finite values are refused as they are decoded (a NaN fp16 block scale
makes its 32 weights NaN, and the model then generates end-of-text without
a word): a :class:`FormatError` naming the tensor. Set
``MIXBITS_ALLOW_NONFINITE=1`` to load such a file anyway.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

from ..errors import FormatError
from ..layout import pack_codes
from .gguf_file import TensorInfo

# ggml type ids (gguf.GGMLQuantizationType values)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16 = 0, 1, 2, 3, 6, 7, 8, 30

# type -> (bits, byte offset of d, of m (None: bias = -offset*d), of qh, of qs, code offset)
_AFFINE = {
    Q4_0: (4, 0, None, None, 2, 8),
    Q4_1: (4, 0, 2, None, 4, 0),
    Q5_0: (5, 0, None, 2, 6, 16),
    Q5_1: (5, 0, 2, 4, 8, 0),
    Q8_0: (8, 0, None, None, 2, 128),
}
_GROUP = 32
_PACK_ROWS = 4096  # rows packed at once for 5 bits (pack_codes makes 32 bytes per code)


def _f16(blocks: np.ndarray, off: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., off:off + 2]).view(np.float16)[..., 0]


def _codes(blocks: np.ndarray, ttype: int) -> np.ndarray:
    """uint8 codes [rows, n_blocks, 32] in element order."""
    bits, _, _, qh_off, qs_off, _ = _AFFINE[ttype]
    if ttype == Q8_0:
        return blocks[..., qs_off:qs_off + 32] ^ np.uint8(0x80)  # int8 q -> q + 128
    qs = blocks[..., qs_off:qs_off + 16]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # low nibbles: elements 0-15
    if bits == 5:  # bit j of the 32-bit qh word is the fifth bit of element j
        qh = np.ascontiguousarray(blocks[..., qh_off:qh_off + 4]).view("<u4")
        high = (qh >> np.arange(32, dtype=np.uint32)) & 1
        codes = codes | (high.astype(np.uint8) << 4)
    return codes


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """MLX's layout (LSB-first bitstream per row) for codes [rows, K]."""
    rows, k = codes.shape
    if bits == 8:
        return np.ascontiguousarray(codes).view("<u4")
    if bits == 4:
        pairs = codes.reshape(rows, k // 2, 2)
        return np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4)).view("<u4")
    out = np.empty((rows, k * bits // 32), dtype=np.uint32)
    for r in range(0, rows, _PACK_ROWS):
        out[r:r + _PACK_ROWS] = pack_codes(codes[r:r + _PACK_ROWS], bits)
    return out


ALLOW_NONFINITE = "MIXBITS_ALLOW_NONFINITE"


def _refuse_nonfinite(t: TensorInfo, what: str, bad: int, total: int) -> None:
    if os.environ.get(ALLOW_NONFINITE, "") not in ("", "0"):
        return
    raise FormatError(f"GGUF tensor {t.name!r} ({t.type_name}): {bad} of its {total} {what} are "
                      f"NaN or infinite; the file is damaged (download it again), or set "
                      f"{ALLOW_NONFINITE}=1 to load it anyway")


def affine_triplet(t: TensorInfo):
    """(codes, scales, biases, bits) for an exactly representable 2-D tensor, else None."""
    if t.type_id not in _AFFINE or len(t.shape) != 2:
        return None
    bits, d_off, m_off, _, _, zero = _AFFINE[t.type_id]
    rows, cols = t.shape
    blocks = t.raw.reshape(rows, cols // _GROUP, -1)
    d = _f16(blocks, d_off)
    m = None if m_off is None else _f16(blocks, m_off)
    for name, v in (("block scales", d), ("block minimums", m)):
        bad = 0 if v is None else v.size - int(np.count_nonzero(np.isfinite(v)))
        if bad:
            _refuse_nonfinite(t, name, bad, v.size)
    bias = (d.astype(np.float32) * -zero).astype(np.float16) if m is None else m
    # With MIXBITS_ALLOW_NONFINITE, or d * -zero overflowing: not representable.
    if not (np.isfinite(d).all() and np.isfinite(bias).all()):
        return None
    codes = _codes(blocks, t.type_id).reshape(rows, cols)
    return _pack(codes, bits), d, bias, bits


def dense(t: TensorInfo, dtype=None) -> mx.array:
    """The tensor as dense floats: F32/F16/BF16 as stored, anything else
    decoded by gguf-py to float32 (then cast to ``dtype`` if given)."""
    import gguf

    if t.type_id == F32:
        out = mx.array(t.raw.view(np.float32).reshape(t.shape))
    elif t.type_id == F16:
        out = mx.array(t.raw.view(np.float16).reshape(t.shape))
    elif t.type_id == BF16:
        out = mx.array(t.raw.view(np.uint16).reshape(t.shape)).view(mx.bfloat16)
    else:
        try:
            qtype = gguf.GGMLQuantizationType(t.type_id)
            values = gguf.quants.dequantize(t.raw, qtype)
        except NotImplementedError as e:
            raise FormatError(f"GGUF tensor {t.name!r}: type {t.type_name} cannot be decoded "
                              f"(gguf-py: {e})") from None
        out = mx.array(values.reshape(t.shape))
    finite = mx.isfinite(out)
    if not mx.all(finite).item():  # K-quant super-scales, or NaN stored as is
        _refuse_nonfinite(t, "values", out.size - int(mx.sum(finite).item()), out.size)
    return out if dtype is None else out.astype(dtype)


def to_mlx(t: TensorInfo, dense_dtype=None) -> dict:
    """{"weight": ...} or {"weight", "scales", "biases"} (plus "bits") for one tensor."""
    trip = affine_triplet(t)
    if trip is None:
        return {"weight": dense(t, dense_dtype)}
    codes, scales, biases, bits = trip
    return {"weight": mx.array(codes), "scales": mx.array(scales), "biases": mx.array(biases), "bits": bits}
