"""The drop-in layers: :class:`MixedQuantizedLinear` (``nn.QuantizedLinear``),
:class:`MixedQuantizedSwitchLinear` (mlx-lm's ``QuantizedSwitchLinear``, an
expert stack) and :class:`MixedQuantizedEmbedding` (``nn.QuantizedEmbedding``,
with ``as_linear`` for a tied head), each called as the layer it replaces."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..layout import QuantizedTensor, Segment
from ..layout import quantize as _quantize
from ..ops import gather_qmatmul, promote_x, qmatmul
from ..repack import gather_rows
from .weight import MixedWeight, normalize_specs, tensor_from_mlx_layer


class MixedQuantizedLinear(MixedWeight):
    """``y = x @ W.T (+ bias)`` with W a mixed-segment mixbits tensor.

    Construct with shapes (zero-filled placeholders, as ``nn.QuantizedLinear``
    does before ``load_weights``), or from an existing layer:
    :meth:`from_linear`, :meth:`from_quantized`, :meth:`from_tensor`.
    """

    def __init__(
        self,
        input_dims: int,
        output_dims: int,
        bias: bool = True,
        segments=None,
        perm: bool = False,
        dtype=mx.float16,
    ):
        super().__init__()
        self._init_placeholders((output_dims,), input_dims, segments, perm, dtype)
        if bias:
            self.bias = mx.zeros((output_dims,), dtype=dtype)
        self.freeze()

    # ------------------------------------------------------------ builders

    @classmethod
    def from_tensor(cls, qt: QuantizedTensor, bias: mx.array | None = None, kinds=None):
        """Wrap an existing QuantizedTensor (no copy, no re-quantization)."""
        if not isinstance(qt, QuantizedTensor):
            raise TypeError(f"qt must be a mixbits.QuantizedTensor, got {type(qt).__name__}")
        _require_batch(qt, 0, "MixedQuantizedLinear")
        n, k = qt.shape
        if bias is not None and (not isinstance(bias, mx.array) or bias.shape != (n,)):
            raise ValueError(f"bias must be an mlx array of shape ({n},), got {getattr(bias, 'shape', bias)!r}")
        return cls._wrap(qt, kinds, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, segments, perm=None, dtype=None):
        """Quantize a float ``nn.Linear`` into ``segments`` (list of
        ``(bits | "ternary", group_size, k_columns)``), optionally through
        an input permutation ``perm``."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an mlx.nn.Linear, got {type(linear).__name__}")
        w = linear.weight
        _, kinds = normalize_specs(segments, w.shape[1])
        qt = _quantize(w, segments, perm=perm, dtype=dtype or w.dtype)
        return cls.from_tensor(qt, linear.get("bias"), kinds)

    @classmethod
    def from_quantized(cls, ql: nn.QuantizedLinear):
        """Take over an ``nn.QuantizedLinear``'s arrays as they are."""
        if not isinstance(ql, nn.QuantizedLinear):
            raise TypeError(f"ql must be an mlx.nn.QuantizedLinear, got {type(ql).__name__}")
        qt = tensor_from_mlx_layer(ql, "QuantizedLinear")
        return cls.from_tensor(qt, ql.get("bias"))._bias_trainable_as_in(ql)

    # ------------------------------------------------------------ call

    @property
    def output_dims(self) -> int:
        if "repacked" in self:
            return self._repacked_tensor().shape[0]
        return self._triplets()[0][0].shape[0]

    # A mixbits.siblings.SiblingGroup when repack_layers grouped this layer
    # with siblings of one input size (a plain attribute, not a parameter).
    sibling_group = None

    def __call__(self, x: mx.array) -> mx.array:
        y = self.sibling_group(self, x) if self.sibling_group is not None else None
        if y is None:
            qt = self.matmul_tensor()
            y = qmatmul(promote_x(x, qt), qt, activations=self._activations)
        if "bias" in self:
            y = y + self["bias"]
        return y

    def _extra_repr(self) -> str:
        return (
            f"input_dims={self.input_dims}, output_dims={self.output_dims}, "
            f"bias={'bias' in self}, {self._layout_repr()}"
        )


def _require_batch(qt: QuantizedTensor, ndim: int, what: str) -> None:
    if len(qt.batch_shape) != ndim:
        raise ValueError(
            f"{what} needs a tensor with {ndim} batch dimension(s), got batch shape {qt.batch_shape}"
        )


def quantize_stack(w, segments, perm=None, dtype=None) -> QuantizedTensor:
    """Quantize an expert stack ``w`` ``(E, N, K)`` into ``segments``, the
    same segments and input permutation for every expert (what one
    MixedQuantizedSwitchLinear holds). Groups run along K within a row, so
    this is :func:`mixbits.quantize` of the ``(E*N, K)`` rows, reshaped."""
    if not isinstance(w, mx.array) or w.ndim != 3:
        raise ValueError(f"an expert stack weight must be an (E, N, K) mlx array, got {getattr(w, 'shape', type(w).__name__)}")
    e, n, k = w.shape
    qt = _quantize(w.reshape(e * n, k), segments, perm=perm, dtype=dtype or w.dtype)
    segs = [
        Segment(s.bits, s.group_size, s.k, *(a.reshape(e, n, -1) for a in (s.wq, s.scales, s.biases)), s.kind)
        for s in qt.segments
    ]
    return QuantizedTensor(segs, qt.perm)


class MixedQuantizedSwitchLinear(MixedWeight):
    """Drop-in for mlx-lm's ``QuantizedSwitchLinear`` (an expert stack,
    ``layer(x, indices, sorted_indices=False)``) with a mixbits weight: every
    expert has the same K-segments and permutation, each expert its own
    codes, scales and biases (arrays ``(E, N, ·)``). Runs
    :func:`mixbits.gather_qmatmul`; optional bias ``(E, N)`` added per
    chosen expert as mlx-lm does. Parameter names as for
    :class:`MixedQuantizedLinear`, so a one-segment layer has exactly
    QuantizedSwitchLinear's ``weight``/``scales``/``biases``/``bias``."""

    def __init__(
        self,
        input_dims: int,
        output_dims: int,
        num_experts: int,
        bias: bool = True,
        segments=None,
        perm: bool = False,
        dtype=mx.float16,
    ):
        super().__init__()
        self._init_placeholders((num_experts, output_dims), input_dims, segments, perm, dtype)
        if bias:
            self.bias = mx.zeros((num_experts, output_dims), dtype=dtype)
        self.freeze()

    @classmethod
    def from_tensor(cls, qt: QuantizedTensor, bias: mx.array | None = None, kinds=None):
        """Wrap a QuantizedTensor with one batch (expert) dimension."""
        if not isinstance(qt, QuantizedTensor):
            raise TypeError(f"qt must be a mixbits.QuantizedTensor, got {type(qt).__name__}")
        _require_batch(qt, 1, "MixedQuantizedSwitchLinear")
        (e,), (n, _) = qt.batch_shape, qt.shape
        if bias is not None and (not isinstance(bias, mx.array) or bias.shape != (e, n)):
            raise ValueError(f"bias must be an mlx array of shape ({e}, {n}), got {getattr(bias, 'shape', bias)!r}")
        return cls._wrap(qt, kinds, bias)

    @classmethod
    def from_switch_linear(cls, sl, segments, perm=None, dtype=None):
        """Quantize a float mlx-lm ``SwitchLinear`` (weight ``(E, N, K)``):
        the same segments (and permutation) for every expert."""
        w = getattr(sl, "weight", None)
        if not isinstance(w, mx.array) or w.ndim != 3:
            raise TypeError(f"sl must be an mlx-lm SwitchLinear with a (E, N, K) weight, got {type(sl).__name__}")
        _, kinds = normalize_specs(segments, w.shape[-1])
        return cls.from_tensor(quantize_stack(w, segments, perm, dtype), sl.get("bias"), kinds)

    @classmethod
    def from_quantized(cls, ql):
        """Take over an mlx-lm ``QuantizedSwitchLinear``'s arrays as they
        are (affine mode without a global scale: the arrays are shared,
        nothing is re-quantized)."""
        wq = ql.get("weight") if isinstance(ql, nn.Module) else None
        if not isinstance(wq, mx.array) or wq.ndim != 3 or "scales" not in ql:
            raise TypeError(f"ql must be an mlx-lm QuantizedSwitchLinear with an (E, N, K*bits/32) "
                            f"weight, got {type(ql).__name__} {getattr(wq, 'shape', '')}")
        layer = cls.from_tensor(tensor_from_mlx_layer(ql, "QuantizedSwitchLinear"), ql.get("bias"))
        return layer._bias_trainable_as_in(ql)

    @property
    def output_dims(self) -> int:
        if "repacked" in self:
            return self._repacked_rows
        return self._triplets()[0][0].shape[-2]

    @property
    def num_experts(self) -> int:
        if "repacked" in self:
            return self["repacked"][0]["weight"].shape[0]
        return self._triplets()[0][0].shape[0]

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        qt = self.matmul_tensor()
        y = gather_qmatmul(promote_x(x, qt), qt, rhs_indices=indices, sorted_indices=sorted_indices,
                           activations=self._activations)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y

    def _extra_repr(self) -> str:
        return (
            f"input_dims={self.input_dims}, output_dims={self.output_dims}, "
            f"num_experts={self.num_experts}, bias={'bias' in self}, {self._layout_repr()}"
        )


class MixedQuantizedEmbedding(MixedWeight):
    """``nn.QuantizedEmbedding`` with a mixbits weight [num_embeddings, dims].

    Lookups dequantize the selected rows (segment by segment, then undo the
    permutation); ``as_linear`` -- the tied output head -- runs
    ``mixbits.qmatmul``.
    """

    def __init__(self, num_embeddings: int, dims: int, segments=None, perm: bool = False, dtype=mx.float16):
        super().__init__()
        self._init_placeholders((num_embeddings,), dims, segments, perm, dtype)
        self.freeze()

    @classmethod
    def from_tensor(cls, qt: QuantizedTensor, kinds=None):
        if not isinstance(qt, QuantizedTensor):
            raise TypeError(f"qt must be a mixbits.QuantizedTensor, got {type(qt).__name__}")
        _require_batch(qt, 0, "MixedQuantizedEmbedding")
        return cls._wrap(qt, kinds)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, segments, perm=None, dtype=None):
        if not isinstance(emb, nn.Embedding):
            raise TypeError(f"emb must be an mlx.nn.Embedding, got {type(emb).__name__}")
        w = emb.weight
        _, kinds = normalize_specs(segments, w.shape[1])
        qt = _quantize(w, segments, perm=perm, dtype=dtype or w.dtype)
        return cls.from_tensor(qt, kinds)

    @classmethod
    def from_quantized(cls, qe: nn.QuantizedEmbedding):
        if not isinstance(qe, nn.QuantizedEmbedding):
            raise TypeError(f"qe must be an mlx.nn.QuantizedEmbedding, got {type(qe).__name__}")
        return cls.from_tensor(tensor_from_mlx_layer(qe, "QuantizedEmbedding"))

    @property
    def num_embeddings(self) -> int:
        if "repacked" in self:
            return self._repacked_rows
        return self._triplets()[0][0].shape[0]

    @property
    def dims(self) -> int:
        return self.input_dims

    def __call__(self, ids: mx.array) -> mx.array:
        if "repacked" in self:
            rows = [gather_rows(seg, ids) for seg in self._repacked_tensor().segments]
        else:
            rows = [(w[ids], s[ids], b[ids]) for w, s, b in self._triplets()]
        parts = [
            mx.dequantize(w, scales=s, biases=b, group_size=g, bits=bits)
            for (bits, g, _), (w, s, b) in zip(self._layout.specs, rows)
        ]
        out = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
        if self._layout.has_perm:
            # Stored column j holds original column perm[j].
            out = mx.take(out, mx.argsort(self["perm"]), axis=-1)
        return out

    def as_linear(self, x: mx.array) -> mx.array:
        """``x @ W.T``: the tied output head, through mixbits.qmatmul."""
        qt = self.matmul_tensor()
        return qmatmul(promote_x(x, qt), qt, activations=self._activations)

    def _extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dims}, {self._layout_repr()}"
