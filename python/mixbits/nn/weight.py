"""The storage every mixbits layer shares (:class:`MixedWeight`): a weight's
K-segments as MLX arrays in the module tree, the QuantizedTensor rebuilt
from them, the numeric contract of its products, and the repacked layout
held instead of MLX's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import mlx.core as mx
import mlx.nn as nn

from ..layout import BITS, DEFAULT_GROUP_SIZE, GROUP_SIZES, TERNARY, QuantizedTensor, Segment, segment_spec
from ..ops import activations_id, repack, unrepack
from ..repack import RepackedSegment, RepackedTensor


@dataclass(frozen=True)
class Layout:
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


def normalize_specs(segments, K: int | None = None, name: str = "segments"):
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


class MixedWeight(nn.Module):
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
        layout = Layout(tuple(qt.specs), kinds, qt.perm is not None)
        layer._set_storage(layout, [(s.wq, s.scales, s.biases) for s in qt.segments], qt.perm)
        layer.freeze()
        if bias is not None:
            layer.bias = bias
            layer.unfreeze(keys=["bias"], recurse=False)
        return layer

    def _init_placeholders(self, rows: tuple, k: int, segments, perm: bool, dtype) -> None:
        """Zero-filled storage for a layer built from shapes (real values
        come from load_weights, as for nn.QuantizedLinear): ``rows`` the
        weight's leading dimensions (``(N,)``, or ``(E, N)`` for an expert
        stack), ``k`` its columns; ``segments`` default to 4-bit g64."""
        if segments is None:
            segments = [(4, DEFAULT_GROUP_SIZE, k)]
        specs, kinds = normalize_specs(segments, k)
        triplets = [
            (mx.zeros((*rows, kk * bits // 32), dtype=mx.uint32),
             mx.ones((*rows, kk // gs), dtype=dtype),
             mx.zeros((*rows, kk // gs), dtype=dtype))
            for bits, gs, kk in specs
        ]
        perm_arr = mx.arange(k, dtype=mx.int32) if perm else None
        self._set_storage(Layout(specs, kinds, bool(perm)), triplets, perm_arr)

    def _set_storage(self, layout: Layout, triplets, perm) -> None:
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
    def layout(self) -> Layout:
        return self._layout

    @property
    def input_dims(self) -> int:
        """The weight's columns K (an embedding's ``dims``)."""
        return sum(k for _, _, k in self._layout.specs)

    def _bias_trainable_as_in(self, source: nn.Module):
        """Give the bias the trainability it had in the ``source`` layer this
        one took over (trainable after nn.quantize, frozen in a layer built
        from shapes); returns self."""
        if "bias" in self and "bias" not in source.trainable_parameters():
            self.freeze(keys=["bias"], recurse=False)
        return self

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
        other calls stay correct (prompts of more than 16 rows on x86
        with AVX2 or AVX-512 read the blocks in place; the rest un-repack
        the weight per call). An
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


def tensor_from_mlx_layer(layer, what: str) -> QuantizedTensor:
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
