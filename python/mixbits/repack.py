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
kernels; every other call un-repacks into a temporary each call, correct
but not fast), and :func:`mixbits.ops.unrepack` gives back the exact
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
