"""Capture and replay around a model's own forward pass.

The sweep never re-implements a model. One reference call ``model(tokens)``
runs with every decoder block wrapped by a recorder that keeps what the
block received (positional and keyword arguments: masks, caches, position
data, whatever the model passes) and what it returned. To measure a tensor
in block i, ``model(tokens)`` is called again with blocks 0..i-1 replaced
by stubs that return their recorded outputs and block i by a branch that
runs the real block once per candidate (on that candidate's slice of the
batch, with the recorded arguments); the model itself computes everything
else (embedding scale, masks, sliding windows, soft-capping, the head).
Candidates share the suffix: the batch is the calibration chunk repeated
once per candidate, along each block's own batch axis (found from the
recorded shapes against the token batch: the axis of the chunk's size that
the sequence axis follows; gemma3n's blocks carry their AltUp streams as
[4, batch, T, D]).

Tensors outside the blocks (embeddings, heads) run the whole model, with
the tensor's module replaced by a leaf branch that applies each
candidate to its slice. A model whose blocks cannot be replayed (no
``layers``, blocks not called exactly once each, replay not reproducing
the reference, or the check failing in any way) falls back to one plain
forward per candidate, with a warning -- slower, never a different network.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import streaming
from ..adapter import ModelAdapter, Site, get_module, set_module


class BlockProxy(nn.Module):
    """Stands in for a module; attributes it lacks come from the original
    (the model may ask a block ``is_linear`` or a head ``as_linear``)."""

    def __init__(self, inner):
        super().__init__()
        object.__setattr__(self, "_inner", inner)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_inner"), name)


def arrays_in(out) -> list:
    """The arrays of a block's output (an array, or a tuple with other parts)."""
    if isinstance(out, mx.array):
        return [out]
    if isinstance(out, (tuple, list)):
        return [a for o in out for a in arrays_in(o)]
    return []


def settle(out, block, root):
    """With ``root`` (a model whose weights stay on disk, see
    :mod:`mixbits.streaming`; None: nothing to do): evaluate the block's
    output now and let go of the block's weights, so a forward holds one
    block's at a time, and of what ran outside the blocks so far (the
    embedding table: the blocks are proxies now, which a release of
    ``root`` does not enter)."""
    if root is not None:
        mx.eval(arrays_in(out))
        streaming.release(block)
        streaming.release(root)
    return out


class _Recorder(BlockProxy):
    def __init__(self, block, index: int, calls: list, root=None):
        super().__init__(block)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_calls", calls)
        object.__setattr__(self, "_root", root)

    def __call__(self, *args, **kwargs):
        out = settle(self._inner(*args, **kwargs), self._inner, self._root)
        self._calls.append((self._index, args, kwargs, out))
        return out


class Streamed(BlockProxy):
    """Runs its block as it is, one block's weights at a time (:func:`settle`
    of ``root``, the model)."""

    def __init__(self, block, root):
        super().__init__(block)
        object.__setattr__(self, "_root", root)

    def __call__(self, *args, **kwargs):
        return settle(self._inner(*args, **kwargs), self._inner, self._root)


class _Stub(BlockProxy):
    """Returns the recorded output of its block, repeated for the batch."""

    def __init__(self, block, out):
        super().__init__(block)
        object.__setattr__(self, "_out", out)

    def __call__(self, *args, **kwargs):
        return self._out


class _BlockBranch(BlockProxy):
    """Runs the real block once per candidate module on its slice of the
    batch, with the block's recorded arguments."""

    def __init__(self, block, path, modules, args, kwargs, b, axes, root=None):
        super().__init__(block)
        for k, v in dict(path=path, modules=modules, args=args,
                         kwargs=kwargs, b=b, axes=axes, root=root).items():
            object.__setattr__(self, "_" + k, v)

    def __call__(self, h, *_, **__):
        block = self._inner
        original = get_module(block, self._path)
        in_axis, out_axes = self._axes
        lead = (slice(None),) * in_axis
        outs = []
        try:
            for g, m in enumerate(self._modules):
                set_module(block, self._path, m)
                x = h[(*lead, slice(g * self._b, (g + 1) * self._b))]
                outs.append(block(x, *self._args[1:], **self._kwargs))
            if self._root is not None:
                mx.eval([a for o in outs for a in arrays_in(o)])
        finally:
            set_module(block, self._path, original)
        return settle(_concat(outs, out_axes), block, self._root)


class _SharedInput(Exception):
    """A leaf's input has no batch axis: candidates need a forward each."""


class _LeafBranch(BlockProxy):
    """Applies candidate module g to slice g of the first argument, for
    every method the model calls (``__call__``, ``as_linear``)."""

    def __init__(self, original, modules, b, t):
        super().__init__(original)
        object.__setattr__(self, "_modules", modules)
        object.__setattr__(self, "_b", b)
        object.__setattr__(self, "_t", t)

    def _split(self, method):
        def run(x, *args, **kwargs):
            b = self._b
            # The batch axis of what the leaf gets (the first, for the usual
            # [batch, T, ...] inputs of embeddings and heads).
            axis = batch_axis(x, b * len(self._modules), self._t)
            if axis is None and (not isinstance(x, mx.array) or x.ndim == 0
                                 or x.shape[0] != b * len(self._modules)):
                if len(self._modules) == 1:
                    return getattr(self._modules[0], method)(x, *args, **kwargs)
                # An input shared by the whole batch (gpt2's position
                # embedding gets arange(T)): no slice per candidate.
                raise _SharedInput(method)
            lead = (slice(None),) * (axis or 0)
            return _concat([getattr(m, method)(x[(*lead, slice(g * b, (g + 1) * b))], *args, **kwargs)
                            for g, m in enumerate(self._modules)], axis or 0)
        return run

    def __call__(self, x, *args, **kwargs):
        return self._split("__call__")(x, *args, **kwargs)

    def __getattr__(self, name):
        attr = super().__getattr__(name)
        return self._split(name) if callable(attr) and not name.startswith("_") else attr


class _InputPass:
    """X^T X (float32 numpy) of what several linears receive over one pass
    (a replay of their block on every chunk, or the model's forward). The
    product runs in numpy: OpenBLAS's sgemm, not MLX's CPU matmul, which on
    Linux is reference BLAS (~40x slower here). Converting an input
    evaluates the block only up to it.

    An input array handed to several linears (q/k/v get the same x, gate
    and up the same x) is converted and multiplied once per call, and
    linears that received the same inputs in the same order share one
    running sum: the same float32 products added in the same order as a
    pass recording one of them alone, so every matrix is bit-identical to
    that pass's. Inputs are told apart by identity (the array object the
    block passes), never by shape or value: q's and o's inputs have the
    same shape. What a call's inputs hold is let go by :meth:`end_call`."""

    def __init__(self):
        self._seen: list = []  # this call's (input, serial, X^T X); holding x keeps its id unique
        self._serials = 0
        self._sums: dict = {}  # serials received so far -> (running X^T X, token count)
        self.recorders: dict = {}  # path -> _InputRecorder

    def add(self, inner, path: str, head_of_embedding: bool = False):
        """A stand-in for ``inner`` that records its input. With
        ``head_of_embedding`` (an embedding): what the model multiplies by
        it as its head (``as_linear``), never the token ids it looks up."""
        cls = _HeadInputRecorder if head_of_embedding else _InputRecorder
        rec = self.recorders[path] = cls(inner, self)
        return rec

    def receive(self, rec, x) -> None:
        got = next(((s, h) for held, s, h in self._seen if held is x), None)
        if got is None:
            x2 = np.array(x.reshape(-1, x.shape[-1]).astype(mx.float32))
            got = (self._serials, x2.T @ x2)
            self._seen.append((x, *got))
            self._serials += 1
        serial, h = got
        old, new = rec._key, rec._key + (serial,)
        if new not in self._sums:
            n = x.size // x.shape[-1]
            if old:
                prev, n0 = self._sums[old]
                self._sums[new] = (prev + h, n0 + n)
            else:
                self._sums[new] = (h, n)
        object.__setattr__(rec, "_key", new)
        if old and all(r._key != old for r in self.recorders.values()):
            del self._sums[old]  # no linear's sum goes on from there

    def end_call(self) -> None:
        self._seen.clear()

    def result(self, path: str):
        """(X^T X, token count) of ``path``'s inputs; (None, 0) when it got none.
        The matrix is read-only: linears that got the same inputs share it."""
        key = self.recorders[path]._key
        if not key:
            return None, 0
        h, n = self._sums[key]
        h.flags.writeable = False
        return h, n


class _InputRecorder(BlockProxy):
    """Passes what a linear receives to its :class:`_InputPass`, then runs it."""

    def __init__(self, inner, rec_pass: _InputPass):
        super().__init__(inner)
        object.__setattr__(self, "_pass", rec_pass)
        object.__setattr__(self, "_key", ())

    def __call__(self, x, *args, **kwargs):
        self._pass.receive(self, x)
        return self._inner(x, *args, **kwargs)


class _HeadInputRecorder(_InputRecorder):
    """An embedding's stand-in: its lookups pass through unrecorded; what
    the model multiplies by it as a tied head (``as_linear``) is recorded."""

    def __call__(self, x, *args, **kwargs):
        return self._inner(x, *args, **kwargs)

    def as_linear(self, x):
        self._pass.receive(self, x)
        return self._inner.as_linear(x)


def _concat(outs, axis=0):
    """Candidates' outputs joined along ``axis`` (per element of a tuple
    output; None: a part without a batch axis, the first candidate's)."""
    if len(outs) == 1:
        return outs[0]
    if isinstance(outs[0], tuple):
        axes = axis if isinstance(axis, tuple) else (axis,) * len(outs[0])
        return tuple(_concat(list(parts), a) for parts, a in zip(zip(*outs), axes))
    return outs[0] if axis is None else mx.concatenate(outs, axis=axis)


def _tile(out, g: int, axis=0):
    """A recorded output repeated for ``g`` candidates along ``axis`` (as
    :func:`_concat`)."""
    if g == 1:
        return out
    if isinstance(out, tuple):
        axes = axis if isinstance(axis, tuple) else (axis,) * len(out)
        return tuple(_tile(o, g, a) for o, a in zip(out, axes))
    return out if axis is None else mx.concatenate([out] * g, axis=axis)


def batch_axis(x, b: int, t: int):
    """The axis of ``x`` holding the token batch: of size ``b`` and followed
    by the sequence axis (size ``t``); None when there is none, or more
    than one (a [4, 4, 4, D] stream with 4 sequences of 4 tokens)."""
    if not isinstance(x, mx.array):
        return None
    axes = [i for i in range(x.ndim - 1) if x.shape[i] == b and x.shape[i + 1] == t]
    return axes[0] if len(axes) == 1 else None


def _out_axes(out, b: int, t: int):
    if isinstance(out, tuple):
        return tuple(batch_axis(o, b, t) for o in out)
    return batch_axis(out, b, t)


def token_chunks(tokens, chunk: int) -> list[mx.array]:
    """Sequences [n_seq, seq_len] in batches of ``chunk`` rows: the unit
    a Replayer records and every pass over calibration tokens runs."""
    tokens = np.asarray(tokens)
    return [mx.array(tokens[i : i + chunk]) for i in range(0, len(tokens), chunk)]


class _Key(str):
    """Where a spilled array sits in its chunk's file (:class:`_Spill`)."""


_SPILL_BYTES = 1 << 16  # smaller arrays (masks, positions) stay in memory


def _template(value, arrays: dict, seen: dict):
    """``value`` with its large arrays replaced by keys into ``arrays``
    (one key per array object: a block's output that is the next block's
    input is written once)."""
    if isinstance(value, mx.array):
        if value.ndim == 0 or value.nbytes < _SPILL_BYTES:
            return value
        key = seen.get(id(value))
        if key is None:
            key = seen[id(value)] = _Key(f"a{len(arrays)}")
            arrays[key] = value
        return key
    if isinstance(value, (tuple, list)):
        return type(value)(_template(v, arrays, seen) for v in value)
    if isinstance(value, dict):
        return {k: _template(v, arrays, seen) for k, v in value.items()}
    return value


def _filled(value, loaded: dict):
    if isinstance(value, _Key):
        return loaded[value]
    if isinstance(value, (tuple, list)):
        return type(value)(_filled(v, loaded) for v in value)
    if isinstance(value, dict):
        return {k: _filled(v, loaded) for k, v in value.items()}
    return value


class _Spill:
    """Per-chunk values of a streaming Replayer (reference logits, recorded
    block calls) kept in temporary safetensors files instead of memory.
    Each access reads them back lazily, so only what a computation
    evaluates is loaded, and only while it runs: a replay from block i
    evaluates block i-1's recorded output, never those of the stubs before
    it (each stub ignores what it is given). Values are bit-identical."""

    def __init__(self, folder: Path, name: str):
        self._folder, self._name, self._items = folder, name, []

    def append(self, value) -> None:
        arrays: dict = {}
        template = _template(value, arrays, {})
        path = self._folder / f"{self._name}{len(self._items)}.safetensors"
        if arrays:
            mx.save_safetensors(str(path), arrays)
        self._items.append((path if arrays else None, template))

    def __getitem__(self, i):
        path, template = self._items[i]
        return _filled(template, mx.load(str(path)) if path else {})

    def __iter__(self):
        return (self[i] for i in range(len(self._items)))

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()


def is_stateful(x) -> bool:
    """A block argument that can hold state between calls: a cache object
    or a dict the block writes into (deepseek_v41 makes its own caches
    when given none). Replaying the recorded call would read what the
    reference forward left there (its keys, not the candidate's: KL 0)."""
    if x is None or isinstance(x, (mx.array, str, int, float, bool)):
        return False
    if isinstance(x, tuple):
        return any(is_stateful(v) for v in x)
    return True


class Replayer:
    """Reference logits of ``model`` on calibration chunks, and logits with
    one tensor replaced by each of several candidate modules."""

    def __init__(self, model, chunks: list[mx.array], adapter: ModelAdapter | None = None, *,
                 logits: bool = True):
        """``logits=False``: a Replayer for :meth:`input_hessian` only
        (quantize, the joint evaluator's X^T X). The reference forward
        still runs the whole model, so the blocks' calls are recorded and
        checked exactly as with logits, but what follows the last block
        (final norm, head) is never evaluated, no reference logits are
        kept, and the replay is checked on one block's recorded call (its
        output given back) instead of from the middle of the model to the
        logits at twice the batch: what :meth:`input_hessian` replays is
        one block's recorded call, never a chain of stubs. The recorded
        calls, and so every X^T X, are the same bits either way. On
        SmolLM2-135M (256 tokens, one thread) 86.5 -> 35.2 CPU-s: the
        check to the logits alone was 47.8."""
        self.model = model
        self.adapter = adapter or ModelAdapter(model)
        self.chunks = chunks
        self.with_logits = bool(logits)
        self.logits: list[mx.array] = []
        self.records: list[list] = []  # [chunk][block] -> (args, kwargs, out)
        self.axes: list[list] = []  # [chunk][block] -> (its input's batch axis, its output's)
        self.replayable = bool(self.adapter.blocks)
        self._inputs: dict = {}  # the last input_hessian pass's {path: (X^T X, tokens)}
        # Weights on disk (mixbits.load(..., lazy=True)): every forward runs
        # block by block, evaluating each and letting its weights go; the
        # reference logits and recorded calls go to disk too, read back per
        # use (:class:`_Spill`), so memory does not grow with the chunks.
        self.stream = streaming.streams(model)
        if self.stream:
            self._spill_dir = tempfile.TemporaryDirectory(prefix="mixbits-replay-")
            folder = Path(self._spill_dir.name)
            self.logits, self.records = _Spill(folder, "logits"), _Spill(folder, "records")
        for toks in chunks:
            self._reference(toks)
        if self.replayable:
            self._check_replay() if self.with_logits else self._check_block_replay()
        if not self.replayable and self.adapter.blocks:
            what = ("measuring with one full forward per candidate" if self.with_logits
                    else "recording layer inputs with full forwards")
            warnings.warn(f"{self.reason}; {what} (slower, same numbers)", RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------ reference

    def _forward(self, toks):
        out = self.model(toks)
        out = (out[0] if isinstance(out, tuple) else out).astype(mx.float32)
        if self.stream:  # the embedding, final norm and head, read by this forward's logits
            mx.eval(out)
            streaming.release(self.model)
        return out

    def _streamed(self, blocks, start: int = 0) -> None:
        """Blocks ``start``.. wrapped to run one at a time (a streaming model)."""
        if self.stream:
            for i in range(start, len(blocks)):
                blocks[i] = Streamed(blocks[i], self.model)

    def _reference(self, toks):
        blocks = self.adapter.blocks
        if not self.replayable:
            if self.with_logits:  # without: input_hessian runs its own full forwards
                logits = self._plain_model(toks)
                mx.eval(logits)
                self.logits.append(logits)
            return
        calls: list = []
        originals = list(blocks)
        try:
            for i, b in enumerate(originals):
                blocks[i] = _Recorder(b, i, calls, self.model if self.stream else None)
            # Without logits the model's output is built but never evaluated:
            # the head costs nothing (lazy), the blocks' calls are all made.
            logits = self._forward(toks) if self.with_logits else self.model(toks)
        except Exception as e:  # the recorders in the way: the plain forward is the reference
            blocks[:] = originals
            self._not_replayable(f"recording the blocks failed ({type(e).__name__}: {e})")
            return self._reference(toks)
        finally:
            blocks[:] = originals
        order = [c[0] for c in calls]
        b, t = int(toks.shape[0]), int(toks.shape[1])
        if order != list(range(len(blocks))) or any(not c[1] for c in calls):
            self._not_replayable("the model does not call its blocks once each, in order, with "
                                 "the hidden state first")
        else:
            recs = [(args, kwargs, out) for _, args, kwargs, out in calls]
            axes = [(batch_axis(args[0], b, t), _out_axes(out, b, t)) for args, _, out in recs]
            bad = [i for i, (a, o) in enumerate(axes)
                   if a is None or (o[0] if isinstance(o, tuple) else o) is None]
            held = next(((i, type(v).__name__) for i, (args, kwargs, _) in enumerate(recs)
                         for v in (*args[1:], *kwargs.values()) if is_stateful(v)), None)
            if bad:
                self._not_replayable(f"block {bad[0]}'s hidden state has no batch axis of size {b} "
                                     f"followed by the sequence ({t})")
            elif held:
                self._not_replayable(f"block {held[0]} gets a {held[1]}, which can carry state from "
                                     "the reference forward into a replay")
            else:
                mx.eval(logits if self.with_logits else [], [r[2] for r in recs])
                self.records.append(recs)
                self.axes.append(axes)
        if self.with_logits:
            mx.eval(logits)
            self.logits.append(logits)

    def _not_replayable(self, reason: str) -> None:
        if self.replayable:
            self.replayable = False
            self.reason = reason
        self.records.clear()
        self.axes.clear()

    def _check_replay(self):
        """Replaying from the middle must give the reference logits back."""
        mid = len(self.adapter.blocks) // 2
        site = next((s for s in self.adapter.sites if s.block == mid), None)
        if site is None:
            return
        # Twice the chunk, as a sweep runs it: the batch axis must be right.
        # Kernels may round differently at another row count, and a model
        # can amplify that (Gemma 3 270M's own forward at batch 2 differs
        # from batch 1 by 0.06 in logits of magnitude 31), which is no fault
        # of the replay: the tolerance admits twice the model's own noise.
        same = self.adapter.get(site.path)
        try:
            logits = self.candidate_logits(0, site, [same, same])
            ref = self.logits[0]
            b = ref.shape[0]
            ok = logits.shape == (2 * b, *ref.shape[1:])
            if ok:
                # Each half against the one reference (the reference tiled
                # twice and the difference were 3 more logits-sized arrays:
                # this check was the sweep's peak).
                def gap(x):
                    return max(float(mx.abs(x[g * b:(g + 1) * b] - ref).max()) for g in range(2))

                tol = 1e-4 * (1 + float(mx.abs(ref).max()))
                err = gap(logits)
                if err > tol:  # only then is the model's own batch-2 forward worth running
                    own = self._plain_model(mx.concatenate([self.chunks[0]] * 2, axis=0))
                    ok = err <= tol + 2 * gap(own)
        except Exception as e:  # the check must never be the crash
            self._not_replayable(f"replaying the recorded blocks failed ({type(e).__name__}: {e})")
            return
        if not ok:
            self._not_replayable("replaying the recorded blocks does not reproduce model(tokens)")

    def _check_block_replay(self):
        """Without logits: the middle block replayed on its recorded call
        (the first chunk's) must give its recorded output back, within
        :meth:`_check_replay`'s tolerance (same arguments and rows: no
        batch noise to admit); anything else, an exception included, means
        full forwards for the layer inputs."""
        mid = len(self.adapter.blocks) // 2
        block = self.adapter.blocks[mid]
        try:
            args, kwargs, out = self.records[0][mid]
            again = settle(block(*args, **kwargs), block, self.model if self.stream else None)
            want, got = arrays_in(out), arrays_in(again)
            ok = len(want) == len(got) and all(a.shape == b.shape for a, b in zip(want, got))
            if ok:
                for a, b in zip(want, got):
                    tol = 1e-4 * (1 + float(mx.abs(a).max()))
                    ok = ok and float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()) <= tol
        except Exception as e:  # the check must never be the crash
            self._not_replayable(f"replaying a recorded block failed ({type(e).__name__}: {e})")
            return
        if not ok:
            self._not_replayable("replaying a recorded block does not give its recorded output back")

    # ------------------------------------------------------------ layer inputs

    def input_hessian(self, site: Site, along=()):
        """(X^T X [K, K] float32 numpy, read-only, token count) of what
        ``site`` (a linear) receives on the calibration set; for an
        embedding, what the model multiplies by it as its head ((None, 0)
        when it is only looked up). A replayable model runs only the site's
        block on its recorded arguments; otherwise (and for sites outside
        the blocks) the whole model.

        ``along``: sites the caller will ask for next (e.g. every calibrated
        linear it builds); those in ``site``'s block are recorded in the
        same pass (:class:`_InputPass`: one replay of the block for all of
        them, an input several share multiplied once) and kept until a site
        outside that pass is asked for. Each matrix is bit-identical to a
        pass recording its site alone. Memory: one pass's matrices at a
        time -- one block's distinct inputs at most (K = 14336 is 0.8 GB
        each), never more than the block's."""
        got = self._inputs.get(site.path)
        if got is not None:
            return got
        self._inputs = {}  # the last pass's matrices go before this pass makes its own
        group = {site.path: site}
        if site.block is not None:
            for s in along:
                if s.block == site.block and s.path not in group:
                    group[s.path] = s
        self._inputs = self._record_inputs(list(group.values()))
        return self._inputs[site.path]

    def forget_inputs(self) -> None:
        """Let go of the matrices :meth:`input_hessian` keeps for the next asks."""
        self._inputs = {}

    def _record_inputs(self, sites: list) -> dict:
        """{path: (X^T X, token count)} of ``sites`` (all in one block when
        the model replays) from one pass."""
        ad = self.adapter
        rec = _InputPass()
        block_i = sites[0].block
        if block_i is not None and self.replayable:
            block = ad.blocks[block_i]
            locals_ = [ad.local_path(s) for s in sites]
            originals = [get_module(block, p) for p in locals_]
            try:
                for p, s, o in zip(locals_, sites, originals):
                    set_module(block, p, rec.add(o, s.path))
                for recs in self.records:
                    args, kwargs, _ = recs[block_i]
                    block(*args, **kwargs)
                    rec.end_call()
            finally:
                for p, o in zip(reversed(locals_), reversed(originals)):
                    set_module(block, p, o)
                streaming.release(block)
        else:
            originals = [ad.get(s.path) for s in sites]
            try:
                for s, o in zip(sites, originals):
                    ad.set(s.path, rec.add(o, s.path, head_of_embedding=s.form == "embedding"))
                for toks in self.chunks:
                    self._plain_model(toks)
                    rec.end_call()
            finally:
                for s, o in zip(reversed(sites), reversed(originals)):
                    ad.set(s.path, o)
        return {s.path: rec.result(s.path) for s in sites}

    # ------------------------------------------------------------ candidates

    def candidate_logits(self, chunk: int, site: Site, modules: list) -> mx.array:
        """float32 logits [len(modules) * b, T, V]: rows g*b..(g+1)*b are
        the model with ``site`` replaced by ``modules[g]``."""
        if not self.with_logits:
            raise ValueError("this Replayer was made with logits=False (layer inputs only): "
                             "it has no reference logits to measure candidates against")
        toks = self.chunks[chunk]
        b, g = toks.shape[0], len(modules)
        batch = mx.concatenate([toks] * g, axis=0) if g > 1 else toks
        ad = self.adapter
        if site.block is None or not self.replayable:
            return self._plain(batch, site, modules, b)
        blocks, recs, axes = ad.blocks, self.records[chunk], self.axes[chunk]
        originals = list(blocks)
        try:
            for i in range(site.block):
                blocks[i] = _Stub(originals[i], _tile(recs[i][2], g, axes[i][1]))
            args, kwargs, _ = recs[site.block]
            blocks[site.block] = _BlockBranch(originals[site.block], ad.local_path(site),
                                              modules, args, kwargs, b, axes[site.block],
                                              self.model if self.stream else None)
            self._streamed(blocks, site.block + 1)
            return self._forward(batch)
        finally:
            blocks[:] = originals

    def _plain_model(self, batch, run=None):
        """``run()`` (default: the model's forward on ``batch``) with every
        block streamed (a model on disk)."""
        blocks = self.adapter.blocks
        originals = list(blocks) if blocks else None
        try:
            if originals:
                self._streamed(blocks)
            return run() if run else self._forward(batch)
        finally:
            if originals:
                blocks[:] = originals

    def _plain(self, batch, site, modules, b):
        return self._plain_model(batch, lambda: self._plain_forward(batch, site, modules, b))

    def _plain_forward(self, batch, site, modules, b):
        ad = self.adapter
        original = ad.get(site.path)
        if site.block is None:
            try:
                ad.set(site.path, _LeafBranch(original, modules, b, int(batch.shape[1])))
                return self._forward(batch)
            except _SharedInput:
                pass  # one forward per candidate, below
            finally:
                ad.set(site.path, original)
        outs = []
        try:
            for m in modules:
                ad.set(site.path, m)
                outs.append(self._forward(batch[:b]))
        finally:
            ad.set(site.path, original)
        return _concat(outs)
