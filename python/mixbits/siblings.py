"""Sibling projections a model applies to one input (q/k/v, gate/up), run
as one graph node per call.

On a decode token each MLX node costs a dispatch of several microseconds,
about as much as a small repacked GEMV's own work, and a llama block calls
five of its seven projections in two bunches on one input each. A
:class:`SiblingGroup` holds the repacked :class:`~mixbits.nn.MixedQuantizedLinear`
children of one module that take the same input size. Which of them the
model calls on the same ``x`` is learned from the model's own calls, not
from names or a re-written forward: a run of calls on one ``x`` object
(``is``), seen twice the same, becomes the fused set. From then on the
first member called computes every member's product in one
:func:`mixbits._ext.repacked_qmatmul_group` node and the others take their
result when they are called with that same ``x``; any other call (another
x, a member outside the set, a changed weight or contract) computes alone.
Each output is bit for bit the member's own product, so fusing changes
speed only.
"""

from __future__ import annotations

import mlx.core as mx

from . import _ext
from ._backends import on_cpu

__all__ = ["SiblingGroup", "install_sibling_groups", "remove_sibling_groups"]


class SiblingGroup:
    """Repacked linear layers of one parent module with one input size."""

    def __init__(self, layers):
        self.layers = list(layers)
        self.fused: tuple[int, ...] | None = None  # member indices, in call order
        self._run: list[int] = []  # the current run of calls on one x
        self._run_x = None
        self._candidate = None  # the last closed run of >= 2 members
        self._pending: dict[int, tuple] = {}  # member -> (its tensor, output) for _run_x

    def __call__(self, layer, x):
        """``layer``'s product with ``x`` (no bias) when the group has it or
        computes it fused, else None (the layer computes alone)."""
        i = self._index(layer)
        if self.fused is None:
            self._learn(i, x)
            return None
        if i not in self.fused:
            return None
        if x is self._run_x and i in self._pending:
            rt, y = self._pending.pop(i)
            if rt is layer.matmul_tensor():
                return y
        return self._compute(i, x)

    def _index(self, layer) -> int:
        for i, m in enumerate(self.layers):
            if m is layer:
                return i
        raise ValueError("layer is not a member of this group")

    def _learn(self, i: int, x) -> None:
        if x is self._run_x and i not in self._run:
            self._run.append(i)
            return
        if len(self._run) >= 2:
            run = tuple(self._run)
            if run == self._candidate:  # the same bunch twice: the model's pattern
                self.fused = run
            self._candidate = run
        self._run, self._run_x = [i], x

    def _compute(self, i: int, x):
        members = [self.layers[j] for j in self.fused]
        act = self.layers[i].activations
        tensors = [m.matmul_tensor() if m.is_repacked else None for m in members]
        if (any(t is None or t.perm is not None for t in tensors)
                or any(t.dtype != tensors[0].dtype for t in tensors)  # one promoted x for all
                or any(m.activations != act for m in members) or not on_cpu()):
            self._pending = {}
            return None
        from .ops import activations_id, promote_x

        xp = promote_x(x, tensors[0])
        outs = _ext.repacked_qmatmul_group(
            xp, [(t.arrays(), t.specs, t.shape[0]) for t in tensors], 0, activations_id(act))
        self._run_x = x
        self._pending = {j: (t, y) for j, t, y in zip(self.fused, tensors, outs) if j != i}
        return outs[self.fused.index(i)]


def install_sibling_groups(model) -> int:
    """A :class:`SiblingGroup` for every module's repacked linear children
    (no permutation) sharing an input size, two or more; returns how many."""
    from .nn import MixedQuantizedLinear

    n = 0
    for _, parent in model.named_modules():
        by_k: dict[int, list] = {}
        for _, child in parent.children().items():
            if (isinstance(child, MixedQuantizedLinear) and child.is_repacked
                    and not child.layout.has_perm):
                by_k.setdefault(child.input_dims, []).append(child)
        for layers in by_k.values():
            if len(layers) >= 2:
                group = SiblingGroup(layers)
                for m in layers:
                    m.sibling_group = group
                n += 1
    return n


def remove_sibling_groups(model) -> None:
    from .nn import MixedQuantizedLinear

    for _, m in model.named_modules():
        if isinstance(m, MixedQuantizedLinear):
            m.sibling_group = None
