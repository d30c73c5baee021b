"""The Fisher pass one block at a time: memory bounded by a block, not the model.

The whole-model pass (:func:`mixbits.measure.grad.fisher_diagonal` with
``blockwise=False``) differentiates ``model(tokens)`` in one backward, which
holds every weight of the model at once (~47 GiB for an 8B model in
bfloat16 with its float32 Fisher totals). The same numbers come out of the
chain rule taken one block at a time:

1. a :class:`~mixbits.measure.replay.Replayer` records, per chunk of
   sequences, every block's arguments and output and the reference logits
   (spilled to disk for a model whose weights stay on disk); the targets
   y_t ~ P(.|x_<t) are drawn from those logits with the same keys, in the
   same order, as the whole-model pass draws them;
2. the model's own forward, with every block returning its recorded output
   and the last returning a variable h, gives by ``mx.vjp`` the cotangent
   dLoss/dh at the last block's output (the final norm, soft-capping and
   head are the model's own code);
3. from the last block to the first: the block's own ``__call__`` on its
   recorded arguments, differentiated by ``mx.vjp`` with the incoming
   cotangent, gives its tapped modules' output gradients (squared weight
   gradients summed into this block's Fisher, exactly as the whole-model
   pass forms them), its expert stacks' weight gradients, and the cotangent
   at its input, which is the previous block's output. Only this block's
   weights are read (lazily) and only its Fisher totals exist; the
   cotangents of every chunk (tokens x hidden each) are kept, so each block
   is visited once;
4. the embedding and head (sites outside the blocks): one more forward of
   the model with the blocks replaced by their recorded outputs, returning
   the hidden state block 0 was given and the loss; its vjp with (block 0's
   input cotangent, 1) gives the embedding rows' and the head's output
   gradients together, so a tied embedding's two uses add up per sequence
   before they are squared, as in the whole-model pass.

The block chain holds only when each block's input is the previous block's
output as it is (checked on the recorded calls); a model whose blocks
cannot be replayed, whose blocks return more than one array, or whose
blocks are chained through other code, runs the whole-model pass (with a
warning). What is differentiated through other arguments (a mask, position
data) is taken as independent of the measured weights.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np

from .. import streaming
from .replay import BlockProxy


def _floats(value) -> list:
    """The floating-point arrays in a block's arguments."""
    if isinstance(value, mx.array):
        return [value] if mx.issubdtype(value.dtype, mx.floating) else []
    if isinstance(value, (tuple, list)):
        return [a for v in value for a in _floats(v)]
    if isinstance(value, dict):
        return [a for v in value.values() for a in _floats(v)]
    return []


class _Given(BlockProxy):
    """A block that returns ``out`` (its recorded output, or the variable the
    head's vjp differentiates) whatever it is given; ``seen``: a list that
    receives the hidden state it was given (block 0, for the embedding);
    ``others``: one that receives the floating arrays among its other
    arguments."""

    def __init__(self, block, out, seen=None, others=None):
        super().__init__(block)
        for k, v in dict(out=out, seen=seen, others=others).items():
            object.__setattr__(self, "_" + k, v)

    def __call__(self, h, *args, **kwargs):
        if self._seen is not None:
            self._seen.append(h)
        if self._others is not None:
            self._others.extend(_floats((args, kwargs)))
        # A new array object: the model's code may write into what a block
        # returns (gemma3n's AltUp streams), which must not reach the record.
        return self._out * 1


def _outside_forward(model, blocks, recs, x, last=None, seen=None, others=None):
    """float32 logits of the model's own forward on ``x`` with every block
    replaced by its recorded output (the last block's by ``last`` if given)."""
    originals = list(blocks)
    try:
        for i, b in enumerate(originals):
            out = last if last is not None and i == len(originals) - 1 else recs[i][2]
            blocks[i] = _Given(b, out, seen if i == 0 else None, others)
        logits = model(x)
    finally:
        blocks[:] = originals
    return (logits[0] if isinstance(logits, tuple) else logits).astype(mx.float32)


def _nll(logits, y):
    lse = mx.logsumexp(logits, axis=-1)
    return (lse - mx.take_along_axis(logits, y[..., None], axis=-1)[..., 0]).sum()


def _feeds_blocks(model, rp, adapter, outside) -> bool:
    """Whether a measured tensor outside the blocks reaches a block through
    an argument other than its hidden state (gemma3n's per-layer inputs,
    made from its embeddings): the vjp of those arguments, with random
    cotangents, to the tensors' outputs is not zero."""
    from .taps import Taps

    tapped = {s.path: adapter.get(s.path) for s in outside if s.form != "stack"}
    recs, x = rp.records[0], rp.chunks[0]
    others: list = []
    with Taps(tapped) as taps:
        taps.capture()
        _outside_forward(model, adapter.blocks, recs, x, others=others)
        if not others or not taps.shapes:
            return False
        deltas = {k: mx.zeros(shape, dtype) for k, (shape, dtype) in taps.shapes.items()}
        keys = list(deltas)

        def fn(*d):
            taps.perturb(dict(zip(keys, d)))
            got: list = []
            _outside_forward(model, adapter.blocks, recs, x, others=got)
            return got

        rng = mx.random.key(1)
        cot = [mx.random.normal(o.shape, key=k).astype(o.dtype)
               for o, k in zip(others, mx.random.split(rng, len(others)))]
        _, g = mx.vjp(fn, list(deltas.values()), cot)
        fed = any(bool(mx.any(v != 0)) for v in g)
    streaming.release(model)
    return fed


def block_chain(model, tokens, batch: int, adapter, sites=()):
    """(Replayer, None) when the block-wise pass can run on ``model`` for
    ``sites``, else (None, the reason)."""
    from .replay import Replayer, token_chunks

    if not adapter.blocks:
        return None, "the model has no decoder blocks the adapter knows"
    with warnings.catch_warnings():  # the Replayer's own fallback message is about the sweep
        warnings.filterwarnings("ignore", message=".*one full forward per candidate")
        rp = Replayer(model, token_chunks(tokens, batch), adapter)
    if not rp.replayable:
        return None, rp.reason
    recs = rp.records[0]  # one read: a spilled chunk keeps its arrays' identity
    for i, (args, _, out) in enumerate(recs):
        if not isinstance(out, mx.array):
            return None, f"block {i} returns {type(out).__name__}, not one hidden state"
        if i and args[0] is not recs[i - 1][2]:
            return None, f"block {i} is not given block {i - 1}'s output as it is"
    outs = {id(r[2]) for r in recs}
    for i, (args, kwargs, _) in enumerate(recs):
        if any(id(a) in outs for a in _floats((args[1:], kwargs))):
            return None, f"block {i} is given a block's output beside its hidden state"
    outside = [s for s in sites if s.block is None]
    if outside and _feeds_blocks(model, rp, adapter, outside):
        return None, ("a measured tensor outside the blocks reaches them through an argument other "
                      "than the hidden state")
    return rp, None


def blockwise_bytes(model, sites, adapter, n_tokens: int, samples: int, hidden: int,
                    itemsize: int, chunk_logits: int, records: int) -> int:
    """Memory the block-wise pass needs: the largest of its stages (one
    block's weights, or the weights outside the blocks, plus the float32
    Fisher totals of that stage's measured tensors and two arrays the size
    of its largest: one sequence's gradient and the product it is summed
    from), the cotangents of every sequence and sample,
    one chunk's float32 logits and the recorded calls held in memory
    (``records``: 0 when spilled to disk)."""
    from mlx.utils import tree_flatten

    def size(module):
        return sum(v.nbytes for _, v in tree_flatten(module.parameters()) if isinstance(v, mx.array))

    blocks = adapter.blocks
    per = [size(b) for b in blocks]
    weights = {i: w for i, w in enumerate(per)}
    weights[None] = size(model) - sum(per)
    stage = {}
    for key, w in weights.items():
        mine = [s.nparams for s in sites if s.block == key]
        stage[key] = w + 4 * sum(mine) + 2 * 4 * max(mine, default=0)
    cot = n_tokens * samples * hidden * itemsize
    return max(stage.values()) + cot + chunk_logits + records


class Unchained(Exception):
    """A block's recorded output is not what the block returns on its
    recorded arguments (the model's code changed it in place before the
    next block read it): the chain rule through the records would skip
    that change."""


def _same_output(i, y, recorded) -> None:
    tol = 1e-4 * (1 + float(mx.abs(recorded).max()))
    if y.shape != recorded.shape or float(mx.abs(y - recorded).max()) > tol:
        raise Unchained(f"block {i}'s recorded output differs from what it returns again (the model "
                        "changes it before the next block)")


def _tap_inputs(taps) -> dict:
    """The tapped modules' recorded inputs as numpy (float32 unless integer
    ids); modules fed the same array share one copy."""
    copies, inputs = {}, {}
    for k, v in taps.inputs.items():
        if id(v) not in copies:
            copies[id(v)] = np.array(v if mx.issubdtype(v.dtype, mx.integer) else v.astype(mx.float32))
        inputs[k] = copies[id(v)]
    return inputs


class _Stage:
    """The measured tensors of one stage (a block, or the sites outside
    the blocks): taps on its modules, float twins of its quantized expert
    stacks, and its Fisher totals."""

    def __init__(self, adapter, sites):
        from .grad import stack_modules

        self.ad = adapter
        self.tapped = {s.path: adapter.get(s.path) for s in sites if s.form != "stack"}
        self.forms = {s.path: s.form for s in sites}
        self.stacks, self.originals = stack_modules(adapter, sites)
        self.fisher = {s.path: np.zeros(s.shape, np.float32) for s in sites}

    def __enter__(self):
        from .taps import Taps

        for p, m in self.originals.items():
            self.ad.set(p, self.stacks[p])
        self.weights0 = {p: m.weight for p, m in self.stacks.items()}
        self.taps = Taps(self.tapped).__enter__()
        return self

    def __exit__(self, *exc):
        self.taps.__exit__(*exc)
        for p, m in self.stacks.items():
            m.weight = self.weights0.get(p, m.weight)
        for p, m in self.originals.items():
            self.ad.set(p, m)
        return False

    def vjp(self, fn, primals: list, cotangents: list, n_seq: int, inputs, out_energy):
        """``fn(*primals)`` run with the taps perturbed and the stacks' weights
        as variables; the Fisher totals get this sample's squared weight
        gradients. ``inputs``: the tapped modules' inputs (:func:`_tap_inputs`)
        or None: recorded in this same forward (the taps' shapes must be
        known: a capture forward, left unevaluated, gives them). Returns
        (the vjps of ``primals``, ``fn``'s outputs, the inputs)."""
        from .grad import accumulate_fisher

        deltas = {k: mx.zeros(shape, dtype) for k, (shape, dtype) in self.taps.shapes.items()}
        dk, wk = list(deltas), list(self.weights0)
        n = len(primals)
        record = inputs is None

        def run(*p):
            self.taps.perturb(dict(zip(dk, p[n:n + len(dk)])), record=record)
            for k, w in zip(wk, p[n + len(dk):]):
                self.stacks[k].weight = w
            return fn(*p[:n])

        outs, g = mx.vjp(run, [*primals, *deltas.values(), *self.weights0.values()], cotangents)
        # One evaluation: the recorded inputs are nodes of the forward the vjp runs.
        mx.eval(outs, g, list(self.taps.inputs.values()) if record else [])
        if record:
            inputs = _tap_inputs(self.taps)
        gd = dict(zip(dk, g[n:n + len(dk)]))
        accumulate_fisher(self.fisher, inputs, gd, self.forms, n_seq, out_energy)
        for k, w in zip(wk, g[n + len(dk):]):
            w = np.array(w.astype(mx.float32))
            self.fisher[k] += w * w
        return g[:n], outs, inputs


def fisher_groups(model, tokens, sites, rp, *, samples: int = 1, seed: int = 0,
                  progress: bool = True, out_energy: dict | None = None, start=None,
                  chain: dict | None = None):
    """Yields {path: Fisher diagonal} per block (last block first), then for
    the sites outside the blocks; ``rp``: :func:`block_chain`'s Replayer.
    Between yields the model is as it was (no proxies, taps or twins).

    Each block's Fisher is summed over every chunk of sequences and sample
    before it is yielded, so a pass killed part way has lost nothing of the
    blocks it yielded; what it needs to go on below them is the loss's
    cotangent at the last yielded block's input, one [tokens, hidden]
    array per chunk and sample. ``chain``: a dict that gets, before each
    block's group is yielded, ``block`` (its index) and ``cotangents``
    (at its input, [chunk][sample]; see :func:`save_cotangents`).
    ``start``: such a (block, cotangents) pair from a pass over the same
    tokens, samples and seed: the backward goes on at the block below
    (the targets are drawn again, the head's vjps are skipped); ``sites``
    must then hold no tensor of that block or above."""
    from tqdm import tqdm

    ad = rp.adapter
    blocks = ad.blocks
    n_chunks = len(rp.chunks)
    outside = [s for s in sites if s.block is None]
    # Without tensors outside the blocks the backward stops at the lowest measured block.
    stop = 0 if outside or not sites else min(s.block for s in sites)
    top = len(blocks)  # the backward starts below this block
    if start is not None:
        top, given = start
        if any(s.block is not None and s.block >= top for s in sites):
            raise ValueError(f"a pass resumed below block {top} cannot measure that block's tensors")
        want = [[tuple(rp.records[c][top][0][0].shape)] * samples for c in range(n_chunks)]
        if [[tuple(g.shape) for g in row] for row in given] != want:
            raise ValueError(f"the cotangents at block {top}'s input do not fit these tokens and "
                             f"samples ({want[0][:1]} x {samples} per chunk, {n_chunks} chunks)")
        stop = min(stop, top)
    key = mx.random.key(seed)
    targets, cots, lasts = [], [], []
    bar = tqdm(total=top - stop + bool(outside), desc="fisher", unit="block",
               disable=not progress)
    for c in range(n_chunks):
        ref = rp.logits[c]
        ys = []
        for _ in range(samples):
            key, sub = mx.random.split(key)
            ys.append(mx.random.categorical(ref, key=sub))  # y_t ~ P(.|x_<t)
        mx.eval(ys)
        targets.append(ys)
        if start is not None and not outside:
            continue  # the cotangents are given and nothing needs the last block's output
        recs, x = rp.records[c], rp.chunks[c]
        # The last block's output recomputed: the model's code after the
        # blocks may write into the recorded one (gemma3n's AltUp streams).
        args, kwargs, _ = recs[-1]
        last = blocks[-1](*args, **kwargs)
        mx.eval(last)
        lasts.append(last)
        if start is not None:
            del recs, args, kwargs
            continue
        row = []
        for y in ys:
            def head(h, recs=recs, x=x, y=y):
                return [_nll(_outside_forward(model, blocks, recs, x, last=h), y)]
            _, (g,) = mx.vjp(head, [last], [mx.array(1.0, mx.float32)])
            mx.eval(g)
            row.append(g)
        cots.append(row)
        del ref, recs, args, kwargs
    if start is not None:
        cots = [list(row) for row in start[1]]
    streaming.release(model)  # the final norm and head, read by the heads' vjps
    for i in reversed(range(stop, top)):
        block = blocks[i]
        with _Stage(ad, [s for s in sites if s.block == i]) as st:
            for c in range(n_chunks):
                args, kwargs, recorded = rp.records[c][i]
                rest = args[1:]
                n_seq = int(rp.chunks[c].shape[0])
                st.taps.capture()
                block(*args, **kwargs)  # not evaluated: only the tapped outputs' shapes
                inputs = None  # recorded by the first sample's differentiated forward
                for s in range(samples):
                    def fn(h, rest=rest, kwargs=kwargs):
                        return [block(h, *rest, **kwargs)]
                    (cots[c][s],), (y,), inputs = st.vjp(fn, [args[0]], [cots[c][s]], n_seq, inputs,
                                                         out_energy)
                    if s == 0 and i < len(blocks) - 1:
                        _same_output(i, y, recorded)
                del inputs, args, kwargs, rest, recorded, y
        streaming.release(block)
        bar.update(1)
        if chain is not None:
            chain.update(block=i, cotangents=cots)
        if st.fisher:
            yield st.fisher
        del st
    if outside:
        with _Stage(ad, outside) as st:
            for c in range(n_chunks):
                recs, x = rp.records[c], rp.chunks[c]
                n_seq = int(x.shape[0])
                st.taps.capture()
                _outside_forward(model, blocks, recs, x, lasts[c])
                mx.eval(list(st.taps.inputs.values()))
                inputs = _tap_inputs(st.taps)
                for s in range(samples):
                    def fn(recs=recs, x=x, y=targets[c][s], last=lasts[c]):
                        seen = []
                        loss = _nll(_outside_forward(model, blocks, recs, x, last, seen), y)
                        return [seen[0], loss]
                    h0 = recs[0][0][0]
                    st.vjp(fn, [], [cots[c][s].astype(h0.dtype), mx.array(1.0, mx.float32)],
                           n_seq, inputs, out_energy)
                del inputs
        streaming.release(model)
        bar.update(1)
        if chain is not None:
            chain.update(block=None, cotangents=None)  # nothing below: no state to go on from
        yield st.fisher
    bar.close()


def save_cotangents(path, block: int, cotangents, key: str) -> None:
    """The block chain's state (``chain`` of :func:`fisher_groups`: the
    cotangents at ``block``'s input) to ``path`` (safetensors, written
    aside and renamed), tagged with ``key``: what the pass depends on."""
    from ..atomic import replace_atomic

    arrays = {f"c{c}_s{s}": g for c, row in enumerate(cotangents) for s, g in enumerate(row)}
    meta = {"block": str(block), "key": key, "chunks": str(len(cotangents)),
            "samples": str(len(cotangents[0]) if cotangents else 0)}
    replace_atomic(path, lambda tmp: mx.save_safetensors(tmp, arrays, meta))


def load_cotangents(path, key: str):
    """(block, cotangents) saved by :func:`save_cotangents` with ``key``, or
    None when ``path`` is absent, unreadable or made for another pass."""
    from pathlib import Path

    if not Path(path).is_file():
        return None
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
        if meta.get("key") != key:
            return None
        n, k = int(meta["chunks"]), int(meta["samples"])
        return int(meta["block"]), [[arrays[f"c{c}_s{s}"] for s in range(k)] for c in range(n)]
    except (OSError, RuntimeError, ValueError, KeyError):
        return None
