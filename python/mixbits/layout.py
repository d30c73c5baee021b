"""Weight layout: segments, packing, permutation. The one place in Python
that knows the bit layout (LSB-first bitstream per row, as MLX stores it).

A quantized tensor W (N outputs x K inputs) is a list of K-segments, each an
MLX affine-quantized matrix with its own bits and group size, plus an
optional input permutation ``perm``: the tensor stores ``w[:, perm]`` and
``qmatmul(x, qt) == x[..., perm] @ qt.dequantize().T``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
# A weight quantized without a group size named: MLX's and mlx-lm's default.
DEFAULT_GROUP_SIZE = 64
FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
TERNARY = "ternary"


@dataclass(frozen=True)
class Segment:
    """One K-segment: MLX's (wq, scales, biases) triplet for ``k`` columns.
    ``kind`` says how the codes were chosen: "affine" (min-max) or
    "ternary" ({-s, 0, +s}, stored as 2-bit affine); the storage is the
    same, the kind travels with it so nobody re-derives it."""

    bits: int
    group_size: int
    k: int
    wq: mx.array
    scales: mx.array
    biases: mx.array
    kind: str = "affine"

    @property
    def spec(self) -> tuple[int, int, int]:
        return (self.bits, self.group_size, self.k)


# ---------------------------------------------------------------- packing


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack integer codes [N, k] (0 <= c < 2**bits) into uint32 [N, k*bits/32].

    Code j of a row occupies bits [j*bits, (j+1)*bits) of the row's
    bitstream; stream bit i lives in word i // 32 at bit i % 32.
    """
    codes = np.asarray(codes)
    n, k = codes.shape
    if (k * bits) % 32:
        raise ValueError(f"k={k} columns at {bits} bits do not fill whole words")
    if codes.size and (codes.min() < 0 or codes.max() >= 1 << bits):
        raise ValueError(f"codes out of range for {bits} bits")
    if n == 0:  # numpy cannot infer a reshape of an empty array
        return np.zeros((0, k * bits // 32), dtype=np.uint32)
    bitplanes = (codes.astype(np.uint32)[..., None] >> np.arange(bits, dtype=np.uint32)) & 1
    packed = np.packbits(bitplanes.astype(np.uint8).reshape(n, -1), axis=1, bitorder="little")
    return np.ascontiguousarray(packed).view(np.uint32).reshape(n, k * bits // 32)


def unpack_codes(wq: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`: uint32 [N, W] -> int codes [N, W*32/bits]."""
    wq = np.ascontiguousarray(np.asarray(wq, dtype=np.uint32))
    n = wq.shape[0]
    stream = np.unpackbits(wq.view(np.uint8).reshape(n, -1), axis=1, bitorder="little")
    weights = (1 << np.arange(bits)).astype(np.int64)
    return stream.reshape(n, -1, bits) @ weights


def ternary_triplet(w: mx.array, group_size: int, dtype=None, chunk: int = 1 << 22):
    """Quantize ``w`` [N, k] to {-s, 0, +s} per group as a 2-bit affine segment.

    s is the group's mean |w| (absmean, as ternary LLMs use); codes 0, 1, 2
    decode as scale * code + bias with scale = s, bias = -s.

    Rows go through numpy ``chunk`` weights at a time: the float32 copy,
    int64 codes and bit planes take ~32 bytes per weight, 2 GB at once for
    a 1B model's head and 17 GB for Llama-3-8B's (refine's peak, issue 40).
    Rows are independent, so the result does not depend on ``chunk``.
    """
    dtype = dtype or w.dtype
    n, k = w.shape
    rows = max(1, chunk // max(k, 1))
    packed, scale_rows = [], []
    for r0 in range(0, n, rows) if n else [0]:
        wn = np.asarray(w[r0 : r0 + rows].astype(mx.float32))
        if not np.isfinite(wn).all():
            # NaN has no ternary code; refuse instead of packing garbage.
            raise ValueError("w has NaN or infinite values, which ternary quantization cannot represent")
        m = wn.shape[0]
        g = wn.reshape(m, k // group_size, group_size)
        s = np.abs(g).mean(axis=-1, keepdims=True)
        s = np.where(s > 0, s, 1.0).astype(np.float32)
        t = np.clip(np.rint(g / s), -1, 1)
        packed.append(pack_codes((t + 1).astype(np.int64).reshape(m, k), 2))
        scale_rows.append(s[..., 0])
    scales = mx.array(np.concatenate(scale_rows)).astype(dtype)
    wq = mx.array(np.concatenate(packed))
    return wq, scales, -scales


# ---------------------------------------------------------------- tensor


def check_int(name: str, v, allowed=None) -> int:
    """``v`` as an int: TypeError for a non-integer type (``4.0``, ``True``,
    ``"4"``: MLX's binding rejects those too), ValueError for a value not in
    ``allowed``."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if allowed is not None and v not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {v!r}")
    return int(v)


def segment_spec(spec, i: int) -> tuple[object, int, int]:
    try:
        bits, group_size, k = spec
    except (TypeError, ValueError):
        raise ValueError(
            f"segments[{i}] must be (bits, group_size, k_columns), got {spec!r}"
        ) from None
    if bits != TERNARY:
        if isinstance(bits, str):
            raise ValueError(f"segments[{i}]: bits must be one of {BITS} or 'ternary', got {bits!r}")
        bits = check_int(f"segments[{i}]: bits", bits, BITS)
    group_size = check_int(f"segments[{i}]: group_size", group_size, GROUP_SIZES)
    check_int(f"segments[{i}]: k_columns", k)
    if k <= 0 or k % group_size:
        raise ValueError(
            f"segments[{i}]: k_columns={k!r} must be a positive multiple of group_size {group_size}"
        )
    return bits, int(group_size), int(k)


def check_perm(perm, K: int) -> mx.array:
    p = np.asarray(perm)
    if p.ndim != 1 or p.shape[0] != K:
        raise ValueError(f"perm must have shape ({K},), got {p.shape}")
    if not np.issubdtype(p.dtype, np.integer):
        raise ValueError(f"perm must be an integer array, got dtype {p.dtype}")
    if not np.array_equal(np.sort(p), np.arange(K)):
        raise ValueError(f"perm is not a permutation of range({K})")
    return mx.array(p.astype(np.int32))


class QuantizedTensor:
    """A mixed-segment quantized matrix; see the module docstring."""

    def __init__(self, segments: Sequence[Segment], perm=None):
        segments = list(segments)
        if not segments:
            raise ValueError("a QuantizedTensor needs at least one segment")
        n = batch = None
        sdtype = getattr(segments[0].scales, "dtype", None)
        for i, s in enumerate(segments):
            if not isinstance(s, Segment):
                raise TypeError(f"segments[{i}] must be a mixbits.layout.Segment")
            segment_spec(s.spec, i)
            if not isinstance(s.wq, mx.array):
                raise TypeError(f"segments[{i}].wq must be an mlx.core.array, got {type(s.wq).__name__}")
            # Array dtypes and shapes are values (ValueError, as in MLX).
            # Leading dimensions are a batch of matrices (an expert stack),
            # the same for every array of every segment.
            if s.wq.dtype != mx.uint32 or s.wq.ndim < 2:
                raise ValueError(f"segments[{i}].wq must be a 2-D (or batched) uint32 array, got {s.wq.dtype} {s.wq.shape}")
            if n is None:
                batch, n = tuple(s.wq.shape[:-2]), s.wq.shape[-2]
            if s.wq.shape != (*batch, n, s.k * s.bits // 32):
                raise ValueError(
                    f"segments[{i}].wq shape {s.wq.shape} != {(*batch, n, s.k * s.bits // 32)}"
                )
            for name in ("scales", "biases"):
                a = getattr(s, name)
                if a is None:
                    raise ValueError(f"segments[{i}].{name} must be provided for affine quantization")
                if not isinstance(a, mx.array):
                    raise TypeError(f"segments[{i}].{name} must be an mlx.core.array, got {type(a).__name__}")
                if a.dtype not in FLOAT_DTYPES:
                    raise ValueError(f"segments[{i}].{name} must be float32/float16/bfloat16, got {a.dtype}")
                if a.dtype != sdtype:
                    raise ValueError(f"segments[{i}].{name} dtype {a.dtype} != segment 0 scales {sdtype}")
                if a.shape != (*batch, n, s.k // s.group_size):
                    raise ValueError(
                        f"segments[{i}].{name} shape {a.shape} != {(*batch, n, s.k // s.group_size)}"
                    )
        self.segments = segments
        self.shape = (n, sum(s.k for s in segments))  # of one matrix
        self.batch_shape = batch
        self.perm = None if perm is None else check_perm(perm, self.shape[1])

    @property
    def specs(self) -> list[tuple[int, int, int]]:
        return [s.spec for s in self.segments]

    @property
    def dtype(self):
        return self.segments[0].scales.dtype

    def arrays(self) -> list[mx.array]:
        out = []
        for s in self.segments:
            out += [s.wq, s.scales, s.biases]
        return out

    def dequantize(self, unpermute: bool = False, dtype=None) -> mx.array:
        """The dense [..., N, K] matrix (batch dims first, if any) in stored
        (permuted) column order, so ``qmatmul(x, qt) == x[..., perm] @
        qt.dequantize().T``. With ``unpermute=True`` columns are in the
        original order instead. ``dtype`` (e.g. float32): scales and biases
        are widened to it first (exactly), so ``s*q + b`` is formed in that
        precision -- as the CPU kernels form it -- instead of being rounded
        to the scales' half precision (MLX's CPU half arithmetic is also
        2-3x slower)."""
        if self.shape[0] == 0 or 0 in self.batch_shape:
            # mx.dequantize cannot reshape an empty array; the answer is known.
            return mx.zeros((*self.batch_shape, *self.shape), dtype=dtype or self.dtype)

        def widen(a):
            return a if dtype is None else a.astype(dtype)

        parts = [
            mx.dequantize(s.wq, widen(s.scales), widen(s.biases), group_size=s.group_size,
                          bits=s.bits)
            for s in self.segments
        ]
        w = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
        if unpermute and self.perm is not None:
            w = mx.take(w, mx.argsort(self.perm), axis=-1)
        return w

    def weighted_error(self, w, weight) -> float:
        """sum(weight * (W - w)**2), W this tensor dequantized as
        ``dequantize(unpermute=True, dtype=float32)`` forms it; ``w`` and
        ``weight``: float arrays of the full shape [..., N, K] in original
        column order. One pass over the codes in C++ (no dense W), float64
        sum: what the gradient proxy evaluates per tensor x candidate."""
        from . import _ext

        full = (*self.batch_shape, *self.shape)
        w, weight = (mx.array(np.asarray(a)) if not isinstance(a, mx.array) else a
                     for a in (w, weight))
        for name, a in (("w", w), ("weight", weight)):
            if tuple(a.shape) != full:
                raise ValueError(f"{name} must have shape {full}, got {tuple(a.shape)}")
        if 0 in full:
            return 0.0
        w, weight = w.astype(mx.float32), weight.astype(mx.float32)
        if self.perm is not None:  # into stored column order, as the segments count
            w, weight = w[..., self.perm], weight[..., self.perm]
        rows = math.prod(full[:-1])
        total, k0 = 0.0, 0
        for s in self.segments:
            cols = (slice(None),) * (len(full) - 1) + (slice(k0, k0 + s.k),)
            total += _ext.weighted_quant_error(
                s.wq.reshape(rows, -1), s.scales.reshape(rows, -1), s.biases.reshape(rows, -1),
                w[cols].reshape(rows, s.k), weight[cols].reshape(rows, s.k), s.bits, s.group_size)
            k0 += s.k
        return total

    @property
    def nbytes(self) -> int:
        n = sum(a.nbytes for a in self.arrays())
        return n + (self.perm.nbytes if self.perm is not None else 0)

    @property
    def bits_per_weight(self) -> float:
        """Storage bits per weight: codes plus scales and biases (perm excluded)."""
        n, k = self.shape
        return 8.0 * sum(a.nbytes for a in self.arrays()) / (n * k * math.prod(self.batch_shape))

    def __repr__(self) -> str:
        segs = ", ".join(f"{b}b/g{g}x{k}" for b, g, k in self.specs)
        p = ", perm" if self.perm is not None else ""
        return f"QuantizedTensor(shape={self.shape}, [{segs}]{p}, {self.bits_per_weight:.3f} bpw)"


def quantize(w, segments, perm=None, dtype=None) -> QuantizedTensor:
    """Quantize ``w`` [N, K] into K-segments.

    ``segments``: list of ``(bits, group_size, k_columns)`` with columns
    summing to K, in order; bits may be ``"ternary"`` (a 2-bit segment with
    codes {0, 1, 2} = {-s, 0, +s}). ``perm``: optional int array of length K;
    the tensor then stores ``w[:, perm]`` and segment columns count in that
    order. Scales and biases take ``dtype`` (default: w's float dtype).
    """
    if not isinstance(w, mx.array):
        w = mx.array(np.asarray(w))
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D [N, K], got shape {w.shape}")
    if w.dtype not in FLOAT_DTYPES:
        raise ValueError(f"w must be float32/float16/bfloat16, got {w.dtype}")
    specs = [segment_spec(s, i) for i, s in enumerate(segments)]
    n, k_total = w.shape
    if sum(k for _, _, k in specs) != k_total:
        raise ValueError(
            f"segment columns sum to {sum(k for _, _, k in specs)} but w has K={k_total}"
        )
    dtype = dtype or w.dtype
    if perm is not None:
        perm = check_perm(perm, k_total)
        w = w[:, perm]
    out, k0 = [], 0
    for bits, gs, k in specs:
        part = w[:, k0 : k0 + k]
        kind = "ternary" if bits == TERNARY else "affine"
        if bits == TERNARY:
            wq, sc, bi = ternary_triplet(part, gs, dtype)
            bits = 2
        else:
            wq, sc, bi = mx.quantize(part.astype(dtype), group_size=gs, bits=bits)
        out.append(Segment(bits, gs, k, wq, sc.astype(dtype), bi.astype(dtype), kind))
        k0 += k
    return QuantizedTensor(out, perm)
