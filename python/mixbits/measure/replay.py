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
once per candidate.

Tensors outside the blocks (embeddings, heads) run the whole model, with
the tensor's module replaced by a leaf branch that applies each
candidate to its slice. A model whose blocks cannot be replayed (no
``layers``, blocks not called exactly once each, replay not reproducing
the reference) falls back to one plain forward per candidate, with a
warning -- slower, never a different network.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..adapter import ModelAdapter, Site, get_module, set_module


class _Proxy(nn.Module):
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


class _Recorder(_Proxy):
    def __init__(self, block, index: int, calls: list):
        super().__init__(block)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_calls", calls)

    def __call__(self, *args, **kwargs):
        out = self._inner(*args, **kwargs)
        self._calls.append((self._index, args, kwargs, out))
        return out


class _Stub(_Proxy):
    """Returns the recorded output of its block, repeated for the batch."""

    def __init__(self, block, out):
        super().__init__(block)
        object.__setattr__(self, "_out", out)

    def __call__(self, *args, **kwargs):
        return self._out


class _BlockBranch(_Proxy):
    """Runs the real block once per candidate module on its slice of the
    batch, with the block's recorded arguments."""

    def __init__(self, block, path, modules, args, kwargs, b):
        super().__init__(block)
        for k, v in dict(path=path, modules=modules, args=args,
                         kwargs=kwargs, b=b).items():
            object.__setattr__(self, "_" + k, v)

    def __call__(self, h, *_, **__):
        block = self._inner
        original = get_module(block, self._path)
        outs = []
        try:
            for g, m in enumerate(self._modules):
                set_module(block, self._path, m)
                x = h[g * self._b : (g + 1) * self._b]
                outs.append(block(x, *self._args[1:], **self._kwargs))
        finally:
            set_module(block, self._path, original)
        return _concat(outs)


class _LeafBranch(_Proxy):
    """Applies candidate module g to slice g of the first argument, for
    every method the model calls (``__call__``, ``as_linear``)."""

    def __init__(self, original, modules, b):
        super().__init__(original)
        object.__setattr__(self, "_modules", modules)
        object.__setattr__(self, "_b", b)

    def _split(self, method):
        def run(x, *args, **kwargs):
            b = self._b
            return _concat([getattr(m, method)(x[g * b : (g + 1) * b], *args, **kwargs)
                            for g, m in enumerate(self._modules)])
        return run

    def __call__(self, x, *args, **kwargs):
        return self._split("__call__")(x, *args, **kwargs)

    def __getattr__(self, name):
        attr = super().__getattr__(name)
        return self._split(name) if callable(attr) and not name.startswith("_") else attr


class _InputRecorder(_Proxy):
    """Accumulates X^T X (float32 numpy) of what a linear receives. The
    product runs in numpy: OpenBLAS's sgemm, not MLX's CPU matmul, which
    on Linux is reference BLAS (~40x slower here). Converting x evaluates
    the block only up to this input."""

    def __init__(self, inner):
        super().__init__(inner)
        object.__setattr__(self, "_h", None)
        object.__setattr__(self, "_n", 0)

    def __call__(self, x, *args, **kwargs):
        x2 = np.array(x.reshape(-1, x.shape[-1]).astype(mx.float32))
        h = x2.T @ x2
        object.__setattr__(self, "_h", h if self._h is None else self._h + h)
        object.__setattr__(self, "_n", self._n + x2.shape[0])
        return self._inner(x, *args, **kwargs)


def _concat(outs):
    if len(outs) == 1:
        return outs[0]
    if isinstance(outs[0], tuple):
        return tuple(_concat(list(parts)) for parts in zip(*outs))
    return mx.concatenate(outs, axis=0)


def _tile(out, g: int):
    if g == 1:
        return out
    if isinstance(out, tuple):
        return tuple(_tile(o, g) for o in out)
    return mx.concatenate([out] * g, axis=0)


def token_chunks(tokens, chunk: int) -> list[mx.array]:
    """Sequences [n_seq, seq_len] in batches of ``chunk`` rows: the unit
    a Replayer records and every pass over calibration tokens runs."""
    tokens = np.asarray(tokens)
    return [mx.array(tokens[i : i + chunk]) for i in range(0, len(tokens), chunk)]


class Replayer:
    """Reference logits of ``model`` on calibration chunks, and logits with
    one tensor replaced by each of several candidate modules."""

    def __init__(self, model, chunks: list[mx.array], adapter: ModelAdapter | None = None):
        self.model = model
        self.adapter = adapter or ModelAdapter(model)
        self.chunks = chunks
        self.logits: list[mx.array] = []
        self.records: list[list] = []  # [chunk][block] -> (args, kwargs, out)
        self.replayable = bool(self.adapter.blocks)
        for toks in chunks:
            self._reference(toks)
        if self.replayable:
            self._check_replay()
        if not self.replayable and self.adapter.blocks:
            warnings.warn(self.reason + "; measuring with one full forward per candidate "
                          "(slower, same numbers)", RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------ reference

    def _forward(self, toks):
        out = self.model(toks)
        return (out[0] if isinstance(out, tuple) else out).astype(mx.float32)

    def _reference(self, toks):
        blocks = self.adapter.blocks
        if not self.replayable:
            logits = self._forward(toks)
            mx.eval(logits)
            self.logits.append(logits)
            return
        calls: list = []
        originals = list(blocks)
        try:
            for i, b in enumerate(originals):
                blocks[i] = _Recorder(b, i, calls)
            logits = self._forward(toks)
        finally:
            blocks[:] = originals
        order = [c[0] for c in calls]
        if order != list(range(len(blocks))) or any(not c[1] for c in calls):
            self.replayable = False
            self.reason = ("the model does not call its blocks once each, in order, with the "
                           "hidden state first")
            self.records.append(None)
        else:
            recs = [(args, kwargs, out) for _, args, kwargs, out in calls]
            mx.eval(logits, [r[2] for r in recs])
            self.records.append(recs)
        mx.eval(logits)
        self.logits.append(logits)

    def _check_replay(self):
        """Replaying from the middle must give the reference logits back."""
        mid = len(self.adapter.blocks) // 2
        site = next((s for s in self.adapter.sites if s.block == mid), None)
        if site is None:
            return
        logits = self.candidate_logits(0, site, [self.adapter.get(site.path)])
        ref = self.logits[0]
        if not mx.allclose(logits, ref, rtol=1e-4, atol=1e-4 * (1 + float(mx.abs(ref).max()))).item():
            self.replayable = False
            self.reason = "replaying the recorded blocks does not reproduce model(tokens)"

    # ------------------------------------------------------------ layer inputs

    def input_hessian(self, site: Site):
        """(X^T X [K, K] float32 numpy, token count) of what ``site`` (a linear)
        receives on the calibration set. A replayable model runs only the
        site's block on its recorded arguments; otherwise the whole model.
        Memory: one K x K matrix at a time (K = 14336 is 0.8 GB)."""
        ad = self.adapter
        if site.block is not None and self.replayable:
            block = ad.blocks[site.block]
            local = ad.local_path(site)
            original = get_module(block, local)
            rec = _InputRecorder(original)
            set_module(block, local, rec)
            try:
                for recs in self.records:
                    args, kwargs, _ = recs[site.block]
                    block(*args, **kwargs)
            finally:
                set_module(block, local, original)
        else:
            original = ad.get(site.path)
            rec = _InputRecorder(original)
            ad.set(site.path, rec)
            try:
                for toks in self.chunks:
                    self._forward(toks)
            finally:
                ad.set(site.path, original)
        return rec._h, rec._n

    # ------------------------------------------------------------ candidates

    def candidate_logits(self, chunk: int, site: Site, modules: list) -> mx.array:
        """float32 logits [len(modules) * b, T, V]: rows g*b..(g+1)*b are
        the model with ``site`` replaced by ``modules[g]``."""
        toks = self.chunks[chunk]
        b, g = toks.shape[0], len(modules)
        batch = mx.concatenate([toks] * g, axis=0) if g > 1 else toks
        ad = self.adapter
        if site.block is None or not self.replayable:
            return self._plain(batch, site, modules, b)
        blocks, recs = ad.blocks, self.records[chunk]
        originals = list(blocks)
        try:
            for i in range(site.block):
                blocks[i] = _Stub(originals[i], _tile(recs[i][2], g))
            args, kwargs, _ = recs[site.block]
            blocks[site.block] = _BlockBranch(originals[site.block], ad.local_path(site),
                                              modules, args, kwargs, b)
            return self._forward(batch)
        finally:
            blocks[:] = originals

    def _plain(self, batch, site, modules, b):
        ad = self.adapter
        original = ad.get(site.path)
        if site.block is None:
            # Leaf branch: inputs of embeddings and heads keep the batch first.
            try:
                ad.set(site.path, _LeafBranch(original, modules, b))
                return self._forward(batch)
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
