"""The row-interleaved ("repacked") layout of a quantized matrix: the CPU's
batch-1 integer GEMV layout (issue 16; ``cpp/qmatmul_int8/repack.h``).

Per segment, 16 output rows form a block; block ``b`` stores word ``j`` of
its 16 rows consecutively (``wq_r[b, j, r] = wq[16*b + r, j]``), and the
scales and biases of group ``g`` likewise (``scales_r[b, g, r]``), so one
512-bit load gives 16 rows' codes and one vector load their scales. A
matrix whose N is not a multiple of 16 gets zero rows at the end of its
last block: ``padding_nbytes`` of extra storage, nothing when 16 divides N.

``REPACK_BITS`` = (2, 3, 4, 8). 2-, 4- and 8-bit words are interleaved as
MLX stores them; 3-bit words (MLX: a bitstream, 32 codes per 3 words) are
first rewritten per chunk of 32 codes into two words of low 2 bits (the
2-bit layout) and one word of 3rd bits (same bytes; repack.h).
:func:`mixbits.ops.repack` refuses 5 and 6 bits with a
:class:`~mixbits.errors.UsageError` (a ValueError), before any kernel runs.

A :class:`RepackedTensor` is an inference layout: :func:`mixbits.qmatmul`
takes it on the CPU (``activations="int8"``/``"int16"`` run the repacked
kernels; float-path calls of more than 40 rows on AVX-512 pack the
prefill GEMM's panels from the blocks; every other call un-repacks into a
temporary each call, correct but not fast), and :func:`mixbits.ops.unrepack` gives back the exact
original :class:`~mixbits.layout.QuantizedTensor` for everything else
(saving, dequantize, gradients, the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

REPACK_ROWS = 16
REPACK_BITS = (2, 3, 4, 8)


@dataclass(frozen=True)
class RepackedSegment:
    """One K-segment in the repacked layout: ``wq_r`` uint32 (blocks,
    k*bits/32, 16), ``scales_r`` and ``biases_r`` (blocks, k/group_size,
    16); ``kind`` as in :class:`~mixbits.layout.Segment`."""

    bits: int
    group_size: int
    k: int
    wq_r: mx.array
    scales_r: mx.array
    biases_r: mx.array
    kind: str = "affine"

    @property
    def spec(self) -> tuple[int, int, int]:
        return (self.bits, self.group_size, self.k)


class RepackedTensor:
    """A 2-D mixed-segment quantized matrix of ``n`` output rows in the
    repacked layout; built by :func:`mixbits.ops.repack`, which checked
    every array."""

    def __init__(self, segments, perm, n: int):
        self.segments = list(segments)
        self.perm = perm
        self.shape = (n, sum(s.k for s in self.segments))

    @property
    def specs(self) -> list[tuple[int, int, int]]:
        return [s.spec for s in self.segments]

    @property
    def dtype(self):
        return self.segments[0].scales_r.dtype

    def arrays(self) -> list[mx.array]:
        out = []
        for s in self.segments:
            out += [s.wq_r, s.scales_r, s.biases_r]
        return out

    @property
    def nbytes(self) -> int:
        n = sum(a.nbytes for a in self.arrays())
        return n + (self.perm.nbytes if self.perm is not None else 0)

    @property
    def padding_nbytes(self) -> int:
        """Bytes of the last block's zero rows: the layout's only storage
        cost over the original."""
        n = self.shape[0]
        pad = -n % REPACK_ROWS
        return sum(a.nbytes * pad // (a.shape[0] * REPACK_ROWS) for a in self.arrays())

    def __repr__(self) -> str:
        segs = ", ".join(f"{b}b/g{g}x{k}" for b, g, k in self.specs)
        p = ", perm" if self.perm is not None else ""
        return f"RepackedTensor(shape={self.shape}, [{segs}]{p}, rows={REPACK_ROWS})"


# ------------------------------------------------------------ row lookups

# Bit of a 3-bit chunk's high word holding bit 2 of chunk code c (repack.h,
# split3_hpos): code 16h + 4p + k sits at bit 8p + (2 + 4h + k) % 8.
_SPLIT3_HPOS = [8 * ((c % 16) // 4) + (2 + 4 * (c // 16) + c % 4) % 8 for c in range(32)]


def _merge3(words: mx.array) -> mx.array:
    """3-bit repacked words (..., 3C) (per chunk of 32 codes: L0, L1, H) back
    to MLX's bitstream (..., 3C), in MLX ops (lazy: usable under mx.compile)."""
    lead, w = words.shape[:-1], words.shape[-1]
    chunks = words.reshape(*lead, w // 3, 3)
    lo = chunks[..., :2, None] >> mx.array([2 * i for i in range(16)], mx.uint32)
    lo = (lo & 3).reshape(*lead, w // 3, 32)
    hi = (chunks[..., 2:3] >> mx.array(_SPLIT3_HPOS, mx.uint32)) & 1
    codes = (lo | (hi << 2)).reshape(*lead, w // 3, 4, 8)
    # MLX: 8 codes per 3 bytes, LSB first (so 32 codes per 3 little-endian words).
    v = (codes << mx.array([3 * j for j in range(8)], mx.uint32)).sum(axis=-1).astype(mx.uint32)
    b = mx.stack([v & 255, (v >> 8) & 255, v >> 16], axis=-1).astype(mx.uint8)
    return mx.view(b.reshape(*lead, w * 4), mx.uint32)


def gather_rows(seg: RepackedSegment, ids: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Rows ``ids`` of a repacked segment in MLX's layout: ``(wq, scales,
    biases)`` of shapes ``(*ids.shape, ·)``, bit for bit what the original
    segment holds there. MLX ops only (lazy, usable under mx.compile): an
    embedding lookup reads its 16-row blocks, never the whole table."""
    block = ids // REPACK_ROWS
    lane = (ids % REPACK_ROWS)[..., None, None]

    def pick(a):
        rows = mx.take(a, block, axis=0)  # (*ids, cols, 16)
        idx = mx.broadcast_to(lane, (*rows.shape[:-1], 1))
        return mx.take_along_axis(rows, idx, axis=-1).squeeze(-1)

    wq = pick(seg.wq_r)
    if seg.bits == 3:
        wq = _merge3(wq)
    return wq, pick(seg.scales_r), pick(seg.biases_r)
