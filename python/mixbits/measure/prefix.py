"""Reusing the unchanged first blocks between joint evaluations.

A decoder block's output depends only on the tokens and on the tensors of
the blocks up to it (and those run before the blocks: the embeddings). Two
assignments that agree on blocks 0..i therefore give the same output of
block i, and a refine search's trials differ from the current allocation
in a few tensors (a swap: two): the blocks before the first changed one
need not run again. :class:`BlockOutputs` keeps recent evaluations' block
outputs by (chunk, block, the assignment up to that block);
:func:`forward` runs ``model(x)`` with the blocks up to a stored one
stubbed (as the sweep's replay does), that one's output fed to the next,
and records the others' outputs.

That is only the model's own forward if the model calls each block once,
in order, hands nothing stateful to them (a cache a stub would not fill)
and takes the stubbed output as the block's: :func:`replays` checks that
on a short piece of the calibration tokens before an evaluator relies on it.
"""

from __future__ import annotations

import mlx.core as mx

from .. import streaming
from .layer_cache import BytesLRU
from .replay import arrays_in, BlockProxy, settle, is_stateful


def signatures(assignment: dict[str, str], sites: dict, n_blocks: int,
               after=frozenset()) -> list[tuple]:
    """For each block i, what its output depends on: the assignment of the
    tensors outside the blocks (all but those in ``after``, seen to run only
    once every block has: the output head) and of blocks 0..i, as a sorted
    tuple."""
    per = [[] for _ in range(n_blocks)]
    outside = []
    for path, cand in sorted(assignment.items()):
        if path in after:
            continue
        site = sites.get(path)
        b = None if site is None else site.block
        (per[b] if b is not None and 0 <= b < n_blocks else outside).append((path, cand))
    out, acc = [], tuple(outside)
    for b in range(n_blocks):
        acc = acc + tuple(per[b])
        out.append(acc)
    return out


class BlockOutputs(BytesLRU):
    """Block outputs by (chunk, block, signature), the least recently used
    dropped once they hold more than ``limit`` bytes. Callers put an
    evaluation's outputs last block first, so that of one evaluation the
    late blocks go first: an early block's output serves more trials (any
    that changes a later block). A key put again keeps its first output
    (the same values) and only becomes the most recent."""

    def __init__(self, limit: int):
        super().__init__(limit, _nbytes)

    def put(self, key, out) -> None:
        if key in self:
            self.get(key)
            return
        super().put(key, out)


def _nbytes(out) -> int:
    return sum(a.nbytes for a in arrays_in(out))


def _alias(out):
    """A new array object for each array of a block's output, sharing its
    data (stop_gradient is an identity): the model's code may write into
    what a block returned (``h[..., :8] = ...``, gemma3n's AltUp streams),
    which must reach neither a stored output nor the next evaluation."""
    if isinstance(out, mx.array):
        return mx.stop_gradient(out)
    if isinstance(out, (tuple, list)):
        return type(out)(_alias(o) for o in out)
    return out


class _Kept(BlockProxy):
    """Runs its block; records (index, args, kwargs, what the block returned)."""

    def __init__(self, block, index: int, calls: list, root=None):
        super().__init__(block)
        for k, v in dict(index=index, calls=calls, root=root).items():
            object.__setattr__(self, "_" + k, v)

    def __call__(self, *args, **kwargs):
        out = settle(self._inner(*args, **kwargs), self._inner, self._root)
        self._calls.append((self._index, args, kwargs, _alias(out)))
        return out


class _Given(BlockProxy):
    """Stands in for a block that need not run: returns a stored output."""

    def __init__(self, block, out):
        super().__init__(block)
        object.__setattr__(self, "_out", out)

    def __call__(self, *args, **kwargs):
        return _alias(self._out)


class _Marker(BlockProxy):
    """Notes, at each call of its module, how many blocks had run."""

    def __init__(self, inner, calls: list, seen: list):
        super().__init__(inner)
        object.__setattr__(self, "_calls", calls)
        object.__setattr__(self, "_seen", seen)

    def __call__(self, *args, **kwargs):
        self._seen.append(len(self._calls))
        return self._inner(*args, **kwargs)


def forward(model, blocks: list, x, start: int = 0, last=None, root=None, calls=None):
    """``model(x)`` with blocks ``0..start-1`` stubbed, each returning ``last``
    (block start-1's output: the only one the next block reads -- what
    :func:`replays` checks), the rest run and recorded. ``root``: the
    model, when its weights stay on disk (each run block evaluated and
    released, as :class:`~mixbits.measure.replay.Streamed` does). Returns
    (output, [(block index, args, kwargs, output)] of the blocks that ran,
    appended to ``calls`` when given)."""
    originals = list(blocks)
    calls = [] if calls is None else calls
    try:
        for i in range(start):
            blocks[i] = _Given(originals[i], last)
        for i in range(start, len(originals)):
            blocks[i] = _Kept(originals[i], i, calls, root)
        out = model(x)
        # The recorded outputs with the forward's: concrete, their graphs dropped.
        mx.eval(arrays_in(out), [c[3] for c in calls])
    finally:
        blocks[:] = originals
    if root is not None:
        streaming.release(model)
    return out, calls


def well_formed(calls: list, start: int, n_blocks: int) -> bool:
    """Blocks start..n-1 called once each, in order, the hidden state
    first, nothing stateful passed."""
    return ([c[0] for c in calls] == list(range(start, n_blocks))
            and all(c[1] and not any(is_stateful(v) for v in (*c[1][1:], *c[2].values()))
                    for c in calls))


def replays(model, blocks: list, x, root=None, outside: dict | None = None):
    """(None, the paths of ``outside`` -- path -> module, the tensors outside
    the blocks -- whose modules were called only after every block) when
    stubbing the first half of the blocks, each returning the recorded
    output of the last of them, gives ``model(x)``'s output back (to float32
    rounding of the logits' scale); else (why not, empty). A model that
    read an earlier block's output other than through the next block, or
    kept state between blocks, would not pass. A module used otherwise than
    by its call (a tied embedding's ``as_linear``) counts where it is called."""
    from ..adapter import set_module

    n = len(blocks)
    if n < 2:
        return "fewer than two blocks", frozenset()
    outside = outside or {}
    calls: list = []
    seen = {p: [] for p in outside}
    try:
        for p, m in outside.items():
            set_module(model, p, _Marker(m, calls, seen[p]))
        try:
            ref, calls = forward(model, blocks, x, 0, None, root, calls)
        finally:
            for p, m in outside.items():
                set_module(model, p, m)
            if root is not None:
                streaming.release(model)  # the release inside did not enter the markers
        if not well_formed(calls, 0, n):
            return ("the model does not call its blocks once each, in order, with the hidden state "
                    "first and nothing stateful"), frozenset()
        mid = n // 2
        out, calls2 = forward(model, blocks, x, mid, calls[mid - 1][3], root)
        if not well_formed(calls2, mid, n):
            return "a replay from the middle does not call the remaining blocks in order", frozenset()
        a = (ref[0] if isinstance(ref, tuple) else ref).astype(mx.float32)
        b = (out[0] if isinstance(out, tuple) else out).astype(mx.float32)
        if a.shape != b.shape:
            return "a replay from the middle changes the output's shape", frozenset()
        gap = float(mx.abs(a - b).max())
        if not gap <= 1e-6 * (1.0 + float(mx.abs(a).max())):
            return f"a replay from the middle moves the logits by {gap:.3g}", frozenset()
    except Exception as e:  # the check must never be the crash
        return f"replaying the recorded blocks failed ({type(e).__name__}: {e})", frozenset()
    return None, frozenset(p for p, s in seen.items() if s and min(s) == n)
