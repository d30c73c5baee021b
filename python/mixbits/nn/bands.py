"""An embedding stored in row bands: :class:`RowBandEmbedding`.

A token's embedding row is read only where the token occurs, so its
quantization error weighs on the model in proportion to the token's
frequency; the K-segments of one mixbits tensor split columns, which every
lookup reads alike. Byte-pair and SentencePiece vocabularies number their
tokens in merge order, frequent pieces first: on Gemma 3's 262,144-token
vocabulary the first 4,096 ids are 54% of the tokens of held-out license
text. Storing those rows at 8 bits and the rest at the allocated kind costs
1.6% of the embedding's rows and cut the lookup share of Gemma's KL at
4b_g64 from 0.164 to 0.068 (docs/measuring.md). Each band is an ordinary
:class:`MixedQuantizedEmbedding` over consecutive rows; the tied head is
their products side by side.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .layers import MixedQuantizedEmbedding


class RowBandEmbedding(nn.Module):
    """``nn.QuantizedEmbedding`` whose rows are held by ``bands``: band 0
    holds rows ``[0, n0)``, band 1 the next ``n1`` rows, and so on, each a
    :class:`MixedQuantizedEmbedding` with its own bits and group size."""

    def __init__(self, bands):
        super().__init__()
        bands = list(bands)
        if len(bands) < 2 or not all(isinstance(b, MixedQuantizedEmbedding) for b in bands):
            raise TypeError("bands must be two or more MixedQuantizedEmbedding layers, got "
                            f"{[type(b).__name__ for b in bands]}")
        dims = {b.dims for b in bands}
        if len(dims) != 1:
            raise ValueError(f"bands must have the same dims, got {sorted(dims)}")
        self.bands = bands
        self.freeze()

    @property
    def rows(self) -> tuple:
        """Rows per band, in order."""
        return tuple(b.num_embeddings for b in self.bands)

    @property
    def num_embeddings(self) -> int:
        return sum(self.rows)

    @property
    def dims(self) -> int:
        return self.bands[0].dims

    @property
    def activations(self) -> str:
        return self.bands[0].activations

    @activations.setter
    def activations(self, value: str) -> None:
        for b in self.bands:
            b.activations = value

    def __call__(self, ids: mx.array) -> mx.array:
        # Every band looks up every id (clipped into its rows) and the band
        # that owns the id wins: a few dequantized rows more per token, no
        # data-dependent shapes.
        out, start = None, 0
        for band in self.bands:
            n = band.num_embeddings
            rows = band(mx.clip(ids - start, 0, n - 1))
            if out is None:
                out = rows
            else:
                out = mx.where(mx.expand_dims(ids >= start, -1), rows, out)
            start += n
        return out

    def as_linear(self, x: mx.array) -> mx.array:
        """``x @ W.T``: the tied output head, band by band."""
        return mx.concatenate([b.as_linear(x) for b in self.bands], axis=-1)

    def dense_weight(self) -> mx.array:
        """The float32 weight [num_embeddings, dims], original column order."""
        return mx.concatenate([b.quantized_tensor().dequantize(unpermute=True, dtype=mx.float32)
                               for b in self.bands], axis=0)

    def weighted_error(self, w: mx.array, weight: mx.array) -> float:
        """sum(weight * (W_q - w)**2) over all rows (``w``, ``weight``: [rows, dims])."""
        total, start = 0.0, 0
        for b in self.bands:
            n = b.num_embeddings
            total += b.quantized_tensor().weighted_error(w[start:start + n], weight[start:start + n])
            start += n
        return total

    def storage_bits(self) -> int:
        """Codes, scales and biases of every band (a permutation left out, as
        ``bits_per_weight`` leaves it out)."""
        return int(sum(round(b.quantized_tensor().bits_per_weight * b.num_embeddings * b.dims)
                       for b in self.bands))

    def config(self) -> dict:
        """config.json's ``mixbits.layers`` descriptor: one per band."""
        return {"bands": [b.layout.config() for b in self.bands]}

    def _extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dims}, rows={list(self.rows)}"
