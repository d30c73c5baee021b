"""The row-interleaved ("repacked") layout of a quantized matrix: the CPU's
batch-1 integer GEMV layout (issue 16; ``cpp/qmatmul_int8/repack.h``).

Per segment, 16 output rows form a block; block ``b`` stores word ``j`` of
its 16 rows consecutively (``wq_r[b, j, r] = wq[16*b + r, j]``), and the
scales and biases of group ``g`` likewise (``scales_r[b, g, r]``), so one
512-bit load gives 16 rows' codes and one vector load their scales. A
matrix whose N is not a multiple of 16 gets zero rows at the end of its
last block: ``padding_nbytes`` of extra storage, nothing when 16 divides N.

``REPACK_BITS`` = (2, 3, 4, 5, 6, 8). 2-, 4- and 8-bit words are
interleaved as MLX stores them; 3-, 5- and 6-bit words (MLX: a bitstream,
32 codes per ``bits`` words) are first rewritten per chunk of 32 codes into
"planes" (same bytes; repack.h): 3 bits as two words of low 2 bits (the
2-bit layout) and one word of 3rd bits, 5 and 6 bits as four words of low
4 bits (the 4-bit layout) and one (5) or two (6) words of the high bits.
That is every width of :data:`mixbits.layout.BITS`; :func:`mixbits.ops.repack`
would refuse a width without a layout with a
:class:`~mixbits.errors.UsageError` (a ValueError), before any kernel runs.

A :class:`RepackedTensor` is an inference layout: :func:`mixbits.qmatmul`
takes it on the CPU (``activations="int8"``/``"int16"`` run the repacked
kernels; float-path calls of more than 16 rows on x86 (AVX-512 or AVX2)
pack the prefill GEMM's panels from the blocks; every other call
un-repacks into a temporary each call, correct but not fast), and
:func:`mixbits.ops.unrepack` gives back the exact original
:class:`~mixbits.layout.QuantizedTensor` for everything else (saving,
dequantize, gradients, the GPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

REPACK_ROWS = 16
REPACK_BITS = (2, 3, 4, 5, 6, 8)


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
    repacked layout, or a stack of them (``batch_shape``: an expert stack);
    built by :func:`mixbits.ops.repack`, which checked every array."""

    def __init__(self, segments, perm, n: int):
        self.segments = list(segments)
        self.perm = perm
        self.shape = (n, sum(s.k for s in self.segments))

    @property
    def batch_shape(self) -> tuple:
        """Leading dims of a stack of matrices (an expert stack: ``(E,)``;
        each matrix repacked on its own); ``()`` for one matrix."""
        return tuple(self.segments[0].wq_r.shape[:-3])

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
        return sum(a.nbytes * pad // (a.shape[-3] * REPACK_ROWS) for a in self.arrays())

    def __repr__(self) -> str:
        segs = ", ".join(f"{b}b/g{g}x{k}" for b, g, k in self.specs)
        p = ", perm" if self.perm is not None else ""
        b = f", batch={self.batch_shape}" if self.batch_shape else ""
        return f"RepackedTensor(shape={self.shape}{b}, [{segs}]{p}, rows={REPACK_ROWS})"


# ------------------------------------------------------------ row lookups

@functools.lru_cache(maxsize=None)
def _planes(bits: int):
    """The planes of a split width (repack.h, split_planes: the one
    definition, read from the extension): (LB, high word of chunk code c,
    its bit there) -- per chunk of 32 codes, LB low-plane words in MLX's
    LB-bit layout, then the high bits of code c at that bit of high word
    LB + word. None for widths kept as MLX's words."""
    from . import _ext

    return _ext.repack_planes(bits)


def _merge_planes(words: mx.array, bits: int) -> mx.array:
    """Repacked words (..., bits*C) of a split width (3, 5, 6) back to MLX's
    bitstream (..., bits*C), in MLX ops (lazy: usable under mx.compile)."""
    lead, w = words.shape[:-1], words.shape[-1]
    lb, hword, hpos = _planes(bits)
    cw = 32 // lb  # codes per low word
    chunks = words.reshape(*lead, w // bits, bits)
    lo = chunks[..., :lb, None] >> mx.array([lb * i for i in range(cw)], mx.uint32)
    lo = (lo & ((1 << lb) - 1)).reshape(*lead, w // bits, 32)
    hw = mx.take(chunks, mx.array([lb + h for h in hword]), axis=-1)
    hi = (hw >> mx.array(hpos, mx.uint32)) & ((1 << (bits - lb)) - 1)
    codes = lo | (hi << lb)  # (..., C, 32)
    # MLX: LSB first, codes straddling words: bit t of the chunk's bitstream
    # is bit t % bits of code t // bits; word i gathers bits 32i .. 32i+31.
    t = mx.arange(32 * bits)
    bit = (mx.take(codes, t // bits, axis=-1) >> (t % bits).astype(mx.uint32)) & 1
    bit = bit.reshape(*lead, w // bits, bits, 32) << mx.arange(32).astype(mx.uint32)
    return bit.sum(axis=-1).astype(mx.uint32).reshape(*lead, w)


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
    if _planes(seg.bits) is not None:
        wq = _merge_planes(wq, seg.bits)
    return wq, pick(seg.scales_r), pick(seg.biases_r)
