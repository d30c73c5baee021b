"""Taps on a model's quantizable modules: record what goes in, let a
gradient come out.

A weight's gradient over one sequence is ``dy^T x`` (output gradient times
input, summed over positions). Differentiating the weights themselves makes
MLX form that product inside the backward pass, with dense float weights,
for every tensor; here the model keeps its own (quantized, mixbits) layers
and MLX only differentiates zero perturbations ``d`` added to each module's
output: ``d/dd loss = dy``. The caller then forms ``dy^T x`` itself, with
the inputs recorded on a first pass.

A tap changes the module's class for the duration of a ``with`` block (a
subclass whose ``__call__`` -- and ``as_linear`` for embeddings used as a
tied head -- records or perturbs), so ``isinstance`` checks and attribute
access in the model's own code are unaffected, and the model's forward is
the one that runs. A module whose weight the model reads directly (not
through a call) is seen only through its calls.
"""

from __future__ import annotations

import mlx.core as mx

_SUBCLASSES: dict[type, type] = {}
_ACTIVE: list = []  # the open Taps (at most one)


def _tapped_class(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is not None:
        return sub
    body = {"_mixbits_tapped": True, "__module__": cls.__module__}

    def __call__(self, x, *args, **kwargs):
        return _ACTIVE[-1].hit(self, "call", x, cls.__call__(self, x, *args, **kwargs))

    body["__call__"] = __call__
    if hasattr(cls, "as_linear"):
        def as_linear(self, x):
            return _ACTIVE[-1].hit(self, "head", x, cls.as_linear(self, x))

        body["as_linear"] = as_linear
    sub = type(cls.__name__, (cls,), body)
    _SUBCLASSES[cls] = sub
    return sub


class Taps:
    """``with Taps(model_modules) as t:`` -- ``modules``: {path: module}.

    Each forward inside the block is run either as ``t.capture()`` (inputs
    and output shapes recorded per call) or ``t.perturb(deltas)`` (outputs
    plus ``deltas[key]``). Keys name one call: ``"path|call|n"`` (the n-th
    call of the module in the forward) or ``"path|head|n"`` (an embedding's
    ``as_linear``)."""

    def __init__(self, modules: dict):
        self.modules = dict(modules)
        self._path = {id(m): p for p, m in self.modules.items()}
        self._mode = None
        self._record = False
        self.inputs: dict[str, mx.array] = {}
        self.shapes: dict[str, tuple] = {}  # key -> (output shape, dtype)
        self._deltas: dict = {}
        self._count: dict = {}
        self._seen: dict = {}  # id(x) -> (x, its recorded copy); x kept so the id stays its own
        self.sources: dict[str, str | None] = {}  # key -> the tapped call whose output is its input
        self._made: dict = {}  # id(y) -> (y, key); y kept so the id stays its own

    def __enter__(self):
        if _ACTIVE:
            raise RuntimeError("taps cannot be nested")
        for m in self.modules.values():
            m.__class__ = _tapped_class(type(m))
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE.pop()
        for m in self.modules.values():
            if getattr(type(m), "_mixbits_tapped", False):
                m.__class__ = type(m).__bases__[0]
        return False

    def capture(self):
        """Start a recording forward (clears earlier records)."""
        self._mode, self._count = "capture", {}
        self.inputs, self.shapes, self._seen = {}, {}, {}
        self.sources, self._made = {}, {}

    def perturb(self, deltas: dict, record: bool = False):
        """Start a forward whose tapped outputs get ``deltas`` added;
        ``record``: the inputs are recorded too, as by :meth:`capture` (a
        differentiated forward that also yields them saves a capture
        forward: they are nodes of the same graph)."""
        self._mode, self._count, self._deltas = "perturb", {}, deltas
        self._record = record
        if record:
            self.inputs, self._seen = {}, {}

    def hit(self, module, tag: str, x, y):
        path = self._path.get(id(module))
        if path is None or self._mode is None:  # a module of the same class, not tapped
            return y
        n = self._count.get((path, tag), 0)
        self._count[(path, tag)] = n + 1
        key = f"{path}|{tag}|{n}"
        if self._mode == "capture":
            # One recorded array per input array: modules fed the same x
            # (q/k/v projections) share it.
            if id(x) not in self._seen:
                self._seen[id(x)] = (x, mx.stop_gradient(x))
            self.inputs[key] = self._seen[id(x)][1]
            self.shapes[key] = (tuple(y.shape), y.dtype)
            # The same array object passed on: e.g. a norm's output fed
            # straight to q/k/v (what a function-preserving rescale needs).
            src = self._made.get(id(x))
            self.sources[key] = src[1] if src is not None else None
            self._made[id(y)] = (y, key)
            return y
        if self._record:
            if id(x) not in self._seen:
                self._seen[id(x)] = (x, mx.stop_gradient(x))
            self.inputs[key] = self._seen[id(x)][1]
        d = self._deltas.get(key)
        if d is None:
            raise RuntimeError(f"{key}: called in this forward but not in the recorded one "
                               "(the model's calls differ between passes)")
        return y + d


def split_key(key: str) -> tuple[str, str]:
    """(module path, "call" or "head") of a tap key."""
    path, tag, _ = key.rsplit("|", 2)
    return path, tag
