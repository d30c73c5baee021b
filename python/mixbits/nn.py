"""Drop-in quantized layers backed by ``mixbits.qmatmul``.

:class:`MixedQuantizedLinear` is called exactly like ``mlx.nn.QuantizedLinear``
(``layer(x)``, optional bias) but its weight is a mixbits tensor: one or more
K-segments (bits, group size, columns; ``"ternary"`` allowed) and an optional
input permutation. :class:`MixedQuantizedEmbedding` does the same for
``mlx.nn.QuantizedEmbedding``, including ``as_linear`` for tied output heads.

Parameters live in the module tree as MLX arrays, so ``model.parameters()``,
``save_weights`` and ``load_weights`` work. Their names:

- one segment, no permutation: ``weight``, ``scales``, ``biases`` (and
  ``bias``) -- exactly the names and layout of ``nn.QuantizedLinear``, so a
  saved file reads back into stock MLX layers;
- otherwise ``segments.<i>.weight/scales/biases`` and ``perm``.

:func:`patch` swaps every affine quantized layer of a loaded model for these
layers without re-quantizing; :func:`quantize_model` applies a per-tensor
assignment of bits / group size / segments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import mlx.core as mx
import mlx.nn as nn

from .layout import BITS, GROUP_SIZES, TERNARY, QuantizedTensor, Segment, segment_spec, check_perm
from .layout import quantize as _quantize
from .errors import UsageError
from .ops import gather_qmatmul, promote_x, qmatmul, repack, unrepack
from .repack import REPACK_BITS, RepackedSegment, RepackedTensor, gather_rows

__all__ = [
    "MixedQuantizedLinear",
    "MixedQuantizedEmbedding",
    "MixedQuantizedSwitchLinear",
    "is_expert_stack",
    "patch",
    "quantize_model",
    "parse_assignment_spec",
    "quantized_layers",
    "quantize_stack",
    "repack_layers",
    "unrepack_layers",
    "repacked_layers",
]

DEFAULT_GROUP_SIZE = 64


@dataclass(frozen=True)
class _Layout:
    """Static description of a layer's weight (not a parameter: MLX would
    try to treat a list attribute as part of the parameter tree)."""

    specs: tuple  # ((bits, group_size, k), ...) as stored; ternary stored as 2
    kinds: tuple  # per segment: "affine" or "ternary"
    has_perm: bool

    @property
    def is_mlx_affine(self) -> bool:
        """True when the stored weight is exactly an MLX affine quantized matrix."""
        return len(self.specs) == 1 and not self.has_perm

    def config(self) -> dict:
        return {
            "segments": [list(s) for s in self.specs],
            "kinds": list(self.kinds),
            "perm": self.has_perm,
        }


def _normalize_specs(segments, K: int | None = None, name: str = "segments"):
    """(bits|'ternary', gs, k) list -> (stored specs, kinds), validated."""
    if isinstance(segments, (str, bytes)) or not isinstance(segments, Iterable):
        raise ValueError(f"{name} must be a list of (bits, group_size, k_columns), got {segments!r}")
    specs, kinds = [], []
    for i, s in enumerate(segments):
        bits, gs, k = segment_spec(s, i)
        kinds.append("ternary" if bits == TERNARY else "affine")
        specs.append((2 if bits == TERNARY else int(bits), gs, k))
    if not specs:
        raise ValueError(f"{name} must hold at least one segment")
    if K is not None and sum(k for _, _, k in specs) != K:
        raise ValueError(
            f"{name}: segment columns sum to {sum(k for _, _, k in specs)} but the weight has K={K}"
        )
    return tuple(specs), tuple(kinds)


def _placeholder_triplet(n: int, bits: int, gs: int, k: int, dtype):
    """Zero-filled storage of the right shapes; real values come from load_weights."""
    return (
        mx.zeros((n, k * bits // 32), dtype=mx.uint32),
        mx.ones((n, k // gs), dtype=dtype),
        mx.zeros((n, k // gs), dtype=dtype),
    )


class _TensorCache:
    """Holds the QuantizedTensor built from the layer's current arrays.
    A plain object on purpose: MLX modules put tuples/lists/arrays into the
    parameter tree, and this must stay out of it. Identity checks (``is``)
    on the held arrays detect replacement by load_weights / update."""

    def __init__(self):
        self.tensor = None
        self.arrays = []


class _SegmentArrays(nn.Module):
    """One segment's ``weight``/``scales``/``biases``. A module, not a dict:
    MLX's ``trainable_parameters`` turns a frozen array inside a plain dict
    into ``{}``, which ``Module.update`` (hence ``nn.value_and_grad`` and
    every optimizer step) then refuses; frozen arrays of a submodule are
    simply left out. Parameter names are unchanged
    (``segments.<i>.weight``)."""

    def __init__(self, w, s, b):
        super().__init__()
        self.weight, self.scales, self.biases = w, s, b


class _MixedWeight(nn.Module):
    """Shared storage logic of the linear and embedding layers."""

    # The CPU matmul's numeric contract for this layer's products (a plain
    # attribute, not a parameter: saving and loading are unchanged).
    # "int8"/"int16" quantize x per group for calls of at most 16 rows; see
    # mixbits.qmatmul (and mixbits.gather_qmatmul for an expert stack: per
    # expert's rows).
    _activations = "float"

    @property
    def activations(self) -> str:
        return self._activations

    @activations.setter
    def activations(self, value: str) -> None:
        from .ops import activations_id

        activations_id(value)  # TypeError / ValueError as qmatmul's argument
        self._activations = value

    @classmethod
    def _wrap(cls, qt: QuantizedTensor, kinds=None, bias=None):
        """A layer holding ``qt``'s arrays as they are (no copy, no
        re-quantization), frozen; a float ``bias`` stays trainable, as after
        nn.QuantizedLinear.from_linear / SwitchLinear.to_quantized. Callers
        check shapes first."""
        kinds = tuple(kinds) if kinds is not None else tuple(seg.kind for seg in qt.segments)
        if len(kinds) != len(qt.segments):
            raise ValueError(f"kinds has {len(kinds)} entries for {len(qt.segments)} segments")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layout = _Layout(tuple(qt.specs), kinds, qt.perm is not None)
        layer._set_storage(layout, [(s.wq, s.scales, s.biases) for s in qt.segments], qt.perm)
        layer.freeze()
        if bias is not None:
            layer.bias = bias
            layer.unfreeze(keys=["bias"], recurse=False)
        return layer

    def _set_storage(self, layout: _Layout, triplets, perm) -> None:
        self._layout = layout
        self._cache = _TensorCache()
        if layout.is_mlx_affine:
            self.weight, self.scales, self.biases = triplets[0]
        else:
            self.segments = [_SegmentArrays(w, s, b) for (w, s, b) in triplets]
            if layout.has_perm:
                self.perm = perm

    def _triplets(self):
        if "repacked" in self:
            # A repacked layer (MixedQuantizedLinear.repack): every reader of
            # the weight gets MLX's layout back, rebuilt on each access.
            return [(s.wq, s.scales, s.biases) for s in self.quantized_tensor().segments]
        if self._layout.is_mlx_affine:
            return [(self["weight"], self["scales"], self["biases"])]
        return [(d["weight"], d["scales"], d["biases"]) for d in self["segments"]]

    @property
    def layout(self) -> _Layout:
        return self._layout

    def quantized_tensor(self) -> QuantizedTensor:
        """The weight as a mixbits QuantizedTensor, rebuilt only when a
        parameter array was replaced (e.g. by load_weights / update). For a
        repacked layer: the original layout, un-repacked on every call (a
        copy of the weight)."""
        if "repacked" in self:
            return unrepack(self._repacked_tensor())
        cache = self._cache
        if self._layout.is_mlx_affine and cache.tensor is not None:
            # Hot path of every forward call: three identity checks.
            a = cache.arrays
            if self["weight"] is a[0] and self["scales"] is a[1] and self["biases"] is a[2]:
                return cache.tensor
        triplets = self._triplets()
        perm = self.get("perm") if self._layout.has_perm else None
        arrays = [a for t in triplets for a in t] + [perm]
        if cache.tensor is None or len(cache.arrays) != len(arrays) or any(
            a is not b for a, b in zip(cache.arrays, arrays)
        ):
            segs = [
                Segment(bits, gs, k, w, s, b, kind)
                for (bits, gs, k), (w, s, b), kind in zip(self._layout.specs, triplets, self._layout.kinds)
            ]
            cache.tensor = QuantizedTensor(segs, perm)
            cache.arrays = arrays
        return cache.tensor

    @property
    def bits_per_weight(self) -> float:
        return self.quantized_tensor().bits_per_weight

    def _layout_repr(self) -> str:
        segs = ", ".join(
            ("ternary" if kind == "ternary" else f"{b}b") + f"/g{g}x{k}"
            for (b, g, k), kind in zip(self._layout.specs, self._layout.kinds)
        )
        return f"[{segs}]" + (", perm" if self._layout.has_perm else "")

    # ------------------------------------------------------------ repacked layout

    @property
    def is_repacked(self) -> bool:
        return "repacked" in self

    def repack(self) -> None:
        """Hold the weight in the row-interleaved layout of the CPU's batch-1
        integer GEMV (:mod:`mixbits.repack`) *instead of* MLX's: the same
        bytes plus the last 16-row block's padding (none when 16 divides
        the output rows). Meant with ``activations="int8"``/``"int16"``;
        other calls stay correct (prompts of more than 16 rows on AVX-512
        read the blocks in place; the rest un-repack the weight per call). An
        embedding's lookups read the rows they need from the repacked
        blocks (:func:`mixbits.repack.gather_rows`); its ``as_linear`` (a
        tied head) runs the repacked kernels.

        The parameters become ``repacked.<i>.weight/scales/biases`` (and
        ``perm``, ``bias`` as before). Readers of the weight
        (:meth:`quantized_tensor`, ``bits_per_weight``) get the original
        layout back; :func:`mixbits.save` refuses a model with repacked
        layers, a gradient with respect to x (or anything upstream) through
        one raises (the trainable ``bias`` still gets its gradient), and the
        GPU refuses it: call :meth:`unrepack` first. Segments with bits
        outside ``REPACK_BITS`` (2, 3, 4, 5, 6, 8) raise a UsageError (a
        ValueError); nothing is changed."""
        if "repacked" in self:
            return
        rt = repack(self.quantized_tensor())
        if self._layout.is_mlx_affine:
            for key in ("weight", "scales", "biases"):
                del self[key]
        else:
            del self["segments"]
        self.repacked = [_SegmentArrays(s.wq_r, s.scales_r, s.biases_r) for s in rt.segments]
        # A plain int (not a parameter): the output rows, which the padded
        # blocks no longer say.
        self._repacked_rows = rt.shape[0]
        for m in self.repacked:
            m.freeze()
        self._cache = _TensorCache()

    def unrepack(self) -> None:
        """Back to MLX's layout, bit for bit (the inverse of :meth:`repack`)."""
        if "repacked" not in self:
            return
        qt = unrepack(self._repacked_tensor())
        del self["repacked"]
        self.sibling_group = None
        bias_trainable = "bias" in self and "bias" in self.trainable_parameters()
        self._set_storage(self._layout, [(s.wq, s.scales, s.biases) for s in qt.segments], qt.perm)
        self.freeze()
        if bias_trainable:
            self.unfreeze(keys=["bias"], recurse=False)

    def matmul_tensor(self):
        """The weight as the matmul takes it: the RepackedTensor of a
        repacked layer, else :meth:`quantized_tensor`'s."""
        return self._repacked_tensor() if "repacked" in self else self.quantized_tensor()

    def _repacked_tensor(self):
        """The repacked weight as a RepackedTensor, rebuilt only when one of
        its arrays was replaced."""
        arrays = [a for d in self["repacked"] for a in (d["weight"], d["scales"], d["biases"])]
        perm = self.get("perm") if self._layout.has_perm else None
        arrays.append(perm)
        cache = self._cache
        if cache.tensor is None or len(cache.arrays) != len(arrays) or any(
            a is not b for a, b in zip(cache.arrays, arrays)
        ):
            segs = [
                RepackedSegment(bits, gs, k, d["weight"], d["scales"], d["biases"], kind)
                for (bits, gs, k), d, kind in zip(self._layout.specs, self["repacked"], self._layout.kinds)
            ]
            cache.tensor = RepackedTensor(segs, perm, self._repacked_rows)
            cache.arrays = arrays
        return cache.tensor


class MixedQuantizedLinear(_MixedWeight):
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
        if segments is None:
            segments = [(4, DEFAULT_GROUP_SIZE, input_dims)]
        specs, kinds = _normalize_specs(segments, input_dims)
        triplets = [_placeholder_triplet(output_dims, b, g, k, dtype) for b, g, k in specs]
        perm_arr = mx.arange(input_dims, dtype=mx.int32) if perm else None
        self._set_storage(_Layout(specs, kinds, bool(perm)), triplets, perm_arr)
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
        specs, kinds = _normalize_specs(segments, w.shape[1])
        qt = _quantize(w, segments, perm=perm, dtype=dtype or w.dtype)
        return cls.from_tensor(qt, linear.get("bias"), kinds)

    @classmethod
    def from_quantized(cls, ql: nn.QuantizedLinear):
        """Take over an ``nn.QuantizedLinear``'s arrays as they are."""
        if not isinstance(ql, nn.QuantizedLinear):
            raise TypeError(f"ql must be an mlx.nn.QuantizedLinear, got {type(ql).__name__}")
        qt = _tensor_from_mlx_layer(ql, "QuantizedLinear")
        layer = cls.from_tensor(qt, ql.get("bias"))
        # The bias keeps the trainability it had in ql (trainable after
        # nn.quantize, frozen in a layer built from shapes).
        if "bias" in layer and "bias" not in ql.trainable_parameters():
            layer.freeze(keys=["bias"], recurse=False)
        return layer

    # ------------------------------------------------------------ call

    @property
    def input_dims(self) -> int:
        return sum(k for _, _, k in self._layout.specs)

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


class MixedQuantizedSwitchLinear(_MixedWeight):
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
        if segments is None:
            segments = [(4, DEFAULT_GROUP_SIZE, input_dims)]
        specs, kinds = _normalize_specs(segments, input_dims)
        triplets = [
            tuple(mx.broadcast_to(a, (num_experts, *a.shape)) * 1
                  for a in _placeholder_triplet(output_dims, b, g, k, dtype))
            for b, g, k in specs
        ]
        perm_arr = mx.arange(input_dims, dtype=mx.int32) if perm else None
        self._set_storage(_Layout(specs, kinds, bool(perm)), triplets, perm_arr)
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
        _, kinds = _normalize_specs(segments, w.shape[-1])
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
        layer = cls.from_tensor(_tensor_from_mlx_layer(ql, "QuantizedSwitchLinear"), ql.get("bias"))
        if "bias" in layer and "bias" not in ql.trainable_parameters():
            layer.freeze(keys=["bias"], recurse=False)
        return layer

    @property
    def input_dims(self) -> int:
        return sum(k for _, _, k in self._layout.specs)

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


class MixedQuantizedEmbedding(_MixedWeight):
    """``nn.QuantizedEmbedding`` with a mixbits weight [num_embeddings, dims].

    Lookups dequantize the selected rows (segment by segment, then undo the
    permutation); ``as_linear`` -- the tied output head -- runs
    ``mixbits.qmatmul``.
    """

    def __init__(self, num_embeddings: int, dims: int, segments=None, perm: bool = False, dtype=mx.float16):
        super().__init__()
        if segments is None:
            segments = [(4, DEFAULT_GROUP_SIZE, dims)]
        specs, kinds = _normalize_specs(segments, dims)
        triplets = [_placeholder_triplet(num_embeddings, b, g, k, dtype) for b, g, k in specs]
        perm_arr = mx.arange(dims, dtype=mx.int32) if perm else None
        self._set_storage(_Layout(specs, kinds, bool(perm)), triplets, perm_arr)
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
        _, kinds = _normalize_specs(segments, w.shape[1])
        qt = _quantize(w, segments, perm=perm, dtype=dtype or w.dtype)
        return cls.from_tensor(qt, kinds)

    @classmethod
    def from_quantized(cls, qe: nn.QuantizedEmbedding):
        if not isinstance(qe, nn.QuantizedEmbedding):
            raise TypeError(f"qe must be an mlx.nn.QuantizedEmbedding, got {type(qe).__name__}")
        return cls.from_tensor(_tensor_from_mlx_layer(qe, "QuantizedEmbedding"))

    @property
    def num_embeddings(self) -> int:
        if "repacked" in self:
            return self._repacked_rows
        return self._triplets()[0][0].shape[0]

    @property
    def dims(self) -> int:
        return sum(k for _, _, k in self._layout.specs)

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


def _tensor_from_mlx_layer(layer, what: str) -> QuantizedTensor:
    mode = getattr(layer, "mode", "affine")
    if mode != "affine":
        raise ValueError(
            f"{what} uses mode={mode!r}; mixbits takes over affine quantized layers only "
            "(other modes have no per-group bias and different scale formats)"
        )
    if layer.bits not in BITS:
        raise ValueError(f"{what} has bits={layer.bits}; mixbits supports bits {BITS}")
    if layer.group_size not in GROUP_SIZES:
        raise ValueError(
            f"{what} has group_size={layer.group_size}; mixbits supports group sizes {GROUP_SIZES}"
        )
    if layer.get("global_scale") is not None:  # mlx-lm's per-expert nvfp4 scale
        raise ValueError(f"{what} has a global scale; mixbits takes over affine layers without one")
    w, s, b = layer["weight"], layer["scales"], layer.get("biases")
    if b is None:
        raise ValueError(f"{what} has no biases; affine layers must have them")
    k = w.shape[-1] * 32 // layer.bits  # the last axis: expert stacks have (E, N, K*bits/32)
    return QuantizedTensor([Segment(layer.bits, layer.group_size, k, w, s, b)])


# ---------------------------------------------------------------- model-level


def _get_child(module, part: str):
    if isinstance(module, list):
        return module[int(part)]
    if isinstance(module, dict):
        return module[part]
    raise KeyError(part)


def _resolve(model: nn.Module, path: str):
    """(parent, last key, module) for a dotted module path; KeyError if absent."""
    parts = path.split(".")
    parent = model
    try:
        for p in parts[:-1]:
            parent = _get_child(parent, p)
        child = _get_child(parent, parts[-1])
    except (KeyError, IndexError, ValueError):
        raise KeyError(path) from None
    return parent, parts[-1], child


def _set_module(model: nn.Module, path: str, new) -> None:
    parent, key, _ = _resolve(model, path)
    if isinstance(parent, list):
        parent[int(key)] = new
    else:
        setattr(parent, key, new)


def quantized_layers(model: nn.Module) -> dict:
    """path -> module for every quantized linear/embedding (stock or mixbits)."""
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding, MixedQuantizedLinear, MixedQuantizedEmbedding)
    return {p: m for p, m in model.named_modules() if isinstance(m, kinds)}


_LINEAR_KINDS = (nn.Linear, nn.QuantizedLinear, MixedQuantizedLinear)
_EMBED_KINDS = (nn.Embedding, nn.QuantizedEmbedding, MixedQuantizedEmbedding)


def _mlx_lm_switch_kinds() -> tuple[tuple, tuple]:
    """mlx-lm's ((SwitchLinear,), (QuantizedSwitchLinear,)), or empty
    tuples when mlx-lm (an optional dependency) is absent: then no model
    has such stacks."""
    try:
        from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
    except ImportError:
        return (), ()
    return (SwitchLinear,), (QuantizedSwitchLinear,)


def is_expert_stack(m) -> bool:
    """An expert stack ``layer(x, indices)`` that :class:`MixedQuantizedSwitchLinear`
    replaces: mlx-lm's float ``SwitchLinear``, its ``QuantizedSwitchLinear``,
    or a mixbits one. Other 3-D weights (mlx-lm's MultiLinear heads) are
    not: they are called without indices."""
    floats, quantized = _mlx_lm_switch_kinds()
    return isinstance(m, floats + quantized + (MixedQuantizedSwitchLinear,))


def weight_layers(model: nn.Module) -> dict:
    """path -> module for every linear or embedding layer, float or quantized:
    the tensors an assignment can name."""
    return {p: m for p, m in model.named_modules() if isinstance(m, _LINEAR_KINDS + _EMBED_KINDS)}


_REPACKABLE = (MixedQuantizedLinear, MixedQuantizedEmbedding, MixedQuantizedSwitchLinear)


def repack_layers(model: nn.Module) -> list[str]:
    """Repack (:meth:`MixedQuantizedLinear.repack`) every mixbits linear,
    embedding (a tied head's table) and expert-stack layer of ``model`` whose segments
    all have bits in ``REPACK_BITS``; the others keep MLX's layout and the
    kernels they had. Returns the repacked paths.

    Repacked linear siblings of one module with one input size (q/k/v,
    gate/up) then share a :class:`mixbits.siblings.SiblingGroup`: once the
    model has called the same ones on one input twice, they run as one
    node per call (bit for bit the same outputs)."""
    from .siblings import install_sibling_groups

    done = []
    for path, m in model.named_modules():
        if isinstance(m, _REPACKABLE) and not m.is_repacked and all(
            bits in REPACK_BITS for bits, _, _ in m.layout.specs
        ):
            m.repack()
            done.append(path)
    install_sibling_groups(model)
    return done


def unrepack_layers(model: nn.Module) -> list[str]:
    """Undo :func:`repack_layers` (bit for bit); returns the paths changed."""
    from .siblings import remove_sibling_groups

    remove_sibling_groups(model)
    done = []
    for path, m in model.named_modules():
        if isinstance(m, _REPACKABLE) and m.is_repacked:
            m.unrepack()
            done.append(path)
    return done


def repacked_layers(model: nn.Module) -> list[str]:
    """Paths of the layers of ``model`` that hold a repacked weight."""
    return [p for p, m in model.named_modules() if isinstance(m, _REPACKABLE) and m.is_repacked]


def patch(model: nn.Module, *, strict: bool = True, functions: bool = True,
          activations: str = "float", repack: bool = False) -> list[str]:
    """Replace, in place, every ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding``
    and every mlx-lm ``QuantizedSwitchLinear`` (expert stack) of ``model``
    by its mixbits counterpart, sharing the same arrays (no
    re-quantization). Returns the replaced module paths.

    With ``functions=True`` (default) the model's causal attention and
    SwiGLU also run on the mixbits CPU kernels
    (:func:`mixbits.routing.patch_functions`).

    Layers mixbits cannot take over (non-affine modes, unsupported bits or
    group sizes) raise a ValueError naming the path, or are left as they are
    with ``strict=False``. Nothing is replaced if any layer fails in strict
    mode.

    ``activations`` sets every mixbits linear layer's (and tied head's)
    numeric contract, replaced or already mixbits: ``"float"`` (default),
    ``"int8"``, ``"int16"`` or ``"int8-all"`` (int8 at every M: prompts
    too; see :func:`mixbits.qmatmul`), expert stacks included (on each
    expert's rows: :func:`mixbits.gather_qmatmul`).

    ``repack=True`` (with an integer ``activations``) then
    stores every mixbits linear, embedding and expert-stack layer (all of 2/3/4/5/6/8-bit
    segments) in the row-interleaved layout of the CPU's batch-1 integer GEMV
    (:func:`repack_layers`; layers with other bits keep MLX's layout).
    Such a model cannot be saved or differentiated, nor run on the GPU,
    until :func:`unrepack_layers`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an mlx.nn.Module, got {type(model).__name__}")
    from .ops import activations_id, repacked_kernels_available

    activations_id(activations)
    if not isinstance(repack, bool):
        raise TypeError(f"repack must be a bool, got {type(repack).__name__}")
    if repack and activations == "float":
        raise UsageError("repack=True is the layout of the integer GEMV: pass activations='int8' or 'int16'")
    if repack and not repacked_kernels_available():
        raise UsageError(
            "repack=True: this CPU has no kernel for the repacked layout (they need AVX2, AVX512-VNNI or arm64 NEON), "
            "so every call would un-repack the weights, slower than MLX's layout; leave repack off")
    _, stock_stacks = _mlx_lm_switch_kinds()
    planned = []
    for path, m in model.named_modules():
        try:
            if isinstance(m, nn.QuantizedLinear):
                planned.append((path, MixedQuantizedLinear.from_quantized(m)))
            elif isinstance(m, nn.QuantizedEmbedding):
                planned.append((path, MixedQuantizedEmbedding.from_quantized(m)))
            elif isinstance(m, stock_stacks):
                planned.append((path, MixedQuantizedSwitchLinear.from_quantized(m)))
        except ValueError as e:
            if strict:
                raise ValueError(f"cannot patch {path!r}: {e}") from None
    for path, new in planned:
        _set_module(model, path, new)
    for _, m in model.named_modules():
        if isinstance(m, _MixedWeight):
            m.activations = activations
    if repack:
        repack_layers(model)
    if functions:
        from .routing import patch_functions

        patch_functions(model)
    return [p for p, _ in planned]


# ---------------------------------------------------------------- assignment


@dataclass(frozen=True)
class TensorSpec:
    """One assignment entry, normalized: segments with original-order
    columns counted after ``perm``."""

    segments: tuple  # ((bits | "ternary", group_size, k), ...) ; k may be None = all of K
    perm: object = None

    def resolve(self, K: int):
        segs = [(b, g, K if k is None else k) for b, g, k in self.segments]
        return segs


def parse_assignment_spec(spec, path: str = "?") -> TensorSpec:
    """Accepted forms of one assignment value:

    - ``4`` (bits; group size 64), ``"ternary"``;
    - ``(bits, group_size)`` or ``{"bits": b, "group_size": g}`` (bits may be
      ``"ternary"``);
    - ``[(bits, group_size, k), ...]`` within-tensor segments;
    - ``{"segments": [...], "perm": array-or-None}``.
    """
    where = f"assignment[{path!r}]"
    if isinstance(spec, TensorSpec):
        return spec
    if isinstance(spec, bool):
        raise ValueError(f"{where}: expected bits, (bits, group_size), or segments, got {spec!r}")
    if isinstance(spec, int) or spec == TERNARY:
        return TensorSpec(((spec, DEFAULT_GROUP_SIZE, None),))
    if isinstance(spec, Mapping):
        if "segments" in spec:
            return TensorSpec(_segment_list(spec["segments"], where), spec.get("perm"))
        if "bits" not in spec:
            raise ValueError(f"{where}: a dict needs 'bits' (and optional 'group_size') or 'segments'")
        return TensorSpec(((spec["bits"], spec.get("group_size", DEFAULT_GROUP_SIZE), None),))
    if isinstance(spec, (list, tuple)):
        if len(spec) == 2 and not isinstance(spec[0], (list, tuple)):
            return TensorSpec(((spec[0], spec[1], None),))
        return TensorSpec(_segment_list(spec, where))
    raise ValueError(f"{where}: expected bits, (bits, group_size), or segments, got {spec!r}")


def _segment_list(segs, where: str) -> tuple:
    out = []
    for i, s in enumerate(segs):
        if not isinstance(s, (list, tuple)) or len(s) != 3:
            raise ValueError(f"{where}: segment {i} must be (bits, group_size, k_columns), got {s!r}")
        out.append(tuple(s))
    if not out:
        raise ValueError(f"{where}: segments list is empty")
    return tuple(out)


def _float_weight(m) -> mx.array:
    """The dense weight of a (possibly quantized) linear, embedding or
    expert stack, original column order."""
    if isinstance(m, _MixedWeight):
        return m.quantized_tensor().dequantize(unpermute=True)
    if "scales" in m:  # a stock quantized layer (QuantizedLinear/Embedding/SwitchLinear)
        return mx.dequantize(
            m["weight"], m["scales"], m.get("biases"), group_size=m.group_size, bits=m.bits,
            mode=getattr(m, "mode", "affine"), global_scale=m.get("global_scale"),
        )
    return m.weight


def quantize_model(model: nn.Module, assignment: Mapping, *, dtype=None) -> list[str]:
    """Quantize the tensors named in ``assignment`` (module path -> spec,
    see :func:`parse_assignment_spec`) in place; other modules are left as
    they are. Linear layers become :class:`MixedQuantizedLinear`, embeddings
    :class:`MixedQuantizedEmbedding`, expert stacks (mlx-lm's
    ``SwitchLinear`` / ``QuantizedSwitchLinear``, or mixbits ones)
    :class:`MixedQuantizedSwitchLinear` with the same segments and
    permutation for every expert. Already-quantized layers are dequantized
    first. Scales/biases take ``dtype`` (default: the source scales' dtype
    for quantized layers, the weight dtype for float ones).

    Every entry is validated (path exists, module kind, segment columns sum
    to K, group sizes divide, permutation) and every new layer built before
    any module is changed. Returns the replaced paths.
    """
    from .adapter import weight_shape

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an mlx.nn.Module, got {type(model).__name__}")
    if not isinstance(assignment, Mapping):
        raise TypeError(f"assignment must be a mapping of module path -> spec, got {type(assignment).__name__}")
    modules = dict(model.named_modules())
    kinds = _LINEAR_KINDS + _EMBED_KINDS + sum(_mlx_lm_switch_kinds(), ()) + (MixedQuantizedSwitchLinear,)
    unknown = [p for p in assignment if p not in modules]
    if unknown:
        known = [p for p, m in modules.items() if isinstance(m, kinds)]
        raise KeyError(
            f"assignment names {len(unknown)} path(s) not in the model: {unknown[:5]}"
            + (" ..." if len(unknown) > 5 else "")
            + f"; quantizable paths look like {known[:3]}"
        )
    plan = []
    for path, raw in assignment.items():
        m = modules[path]
        if not isinstance(m, kinds):
            raise TypeError(
                f"assignment[{path!r}]: module is {type(m).__name__}, not a linear, embedding "
                "or expert-stack (SwitchLinear) layer"
            )
        spec = parse_assignment_spec(raw, path)
        w_shape = weight_shape(m)
        segs = spec.resolve(w_shape[-1])
        try:
            _normalize_specs(segs, w_shape[-1])
            perm = None if spec.perm is None else check_perm(spec.perm, w_shape[-1])
        except ValueError as e:
            raise ValueError(f"assignment[{path!r}]: {e} (weight shape {w_shape})") from None
        plan.append((path, m, segs, perm))
    # All layers are built before the first swap: a failure while
    # quantizing (e.g. a source layer that cannot be dequantized) leaves
    # the model as it was.
    built = []
    for path, m, segs, perm in plan:
        w = _float_weight(m)
        if dtype is not None:
            dt = dtype
        elif isinstance(m, _MixedWeight):
            dt = m.quantized_tensor().dtype
        elif "scales" in m:
            dt = m["scales"].dtype
        else:
            dt = w.dtype
        _, seg_kinds = _normalize_specs(segs)
        if is_expert_stack(m):
            new = MixedQuantizedSwitchLinear.from_tensor(quantize_stack(w, segs, perm, dt), m.get("bias"), seg_kinds)
        elif isinstance(m, _LINEAR_KINDS):
            new = MixedQuantizedLinear.from_tensor(_quantize(w, segs, perm=perm, dtype=dt), m.get("bias"), seg_kinds)
        else:
            new = MixedQuantizedEmbedding.from_tensor(_quantize(w, segs, perm=perm, dtype=dt), seg_kinds)
        mx.eval(new.parameters())
        built.append((path, new))
    for path, new in built:
        _set_module(model, path, new)
    return [p for p, _ in built]
