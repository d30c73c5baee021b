"""Joint KL: quantize every tensor as an assignment says, run the whole
model on calibration sequences, KL of the final logits vs the reference.

Where the time goes (bench/joint_profile.py, a 1B Llama-shaped float16
folder): the quantized linears are ~85% of an evaluation, running at about
the quantized GEMM's own rate; quantizing the layers of a candidate never
used before costs ~3 one-sequence evaluations, and is done once per
(tensor, candidate). So an evaluation does less rather than faster: an
assignment scored before is not run again, and the blocks before the first
one an assignment changes are not either (:mod:`.prefix`)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..adapter import ModelAdapter
from ..layout import DEFAULT_GROUP_SIZE
from .candidates import build_layer, embed_candidates, needs_inputs, parse_candidate
from .sweep import kl_per_token

# The reference side's forms (``reference=``): float32 logits as the forward
# gives them, or mixbits.kl.KLReference's "probs16" (the probabilities'
# weights in float16 + each row's sum p log p in float64: half the bytes,
# KL within ~1e-4 relative of the float32 path, tests/test_joint_reference.py).
REFERENCES = ("auto", "logits", "probs16")
# "auto" keeps float32 logits up to this many bytes for all the tokens, and
# probs16 above: SmolLM2 (V = 49,152) at 16 x 256 tokens is 0.8 GB, float32;
# Gemma-3-270M (V = 262,144) at 8 x 256 is 2.1 GB, and 1.1 GB as probs16.
REFERENCE_F32_LIMIT = 1 << 30


class JointEvaluator:
    """Holds the reference logits and a cache of quantized candidate layers,
    so trying many assignments re-quantizes each (tensor, candidate) once."""

    def __init__(self, model, tokens, chunk: int = 4, scale_dtype=mx.float16, calibration=None,
                 reuse_blocks: bool = True, prefix_bytes: int | None = None, layer_limit="auto",
                 reference: str = "auto", same_reference: "JointEvaluator | None" = None):
        """``calibration``: another evaluator whose tokens calibrated
        candidates (``+gptq``...) are fitted on, and whose layer cache this
        one shares -- so scoring on held-out tokens never fits on them.
        ``reuse_blocks``: keep recent evaluations' block outputs (up to
        ``prefix_bytes``; default an eighth of the available memory, at most
        2 GiB) and start a later evaluation at the first block it changes,
        when the model's forward allows it (:func:`.prefix.replays`;
        ``reuse_reason`` says why not otherwise). ``layer_limit``: bytes of
        built candidate layers kept (:class:`.layer_cache.LayerCache`);
        "auto": 3/8 of the memory available once the reference logits are
        in; None: no limit. Ignored with ``calibration`` (its cache is used).
        ``reference``: how the reference logits are held (:data:`REFERENCES`):
        "logits" (float32), "probs16" (a :class:`mixbits.kl.KLReference`
        per chunk, half the bytes), or "auto": float32 unless the float32
        logits of all the tokens would exceed :data:`REFERENCE_F32_LIMIT`
        (decided on the first chunk's vocabulary; ``self.reference`` says which).
        ``same_reference``: an evaluator of the same model on the same tokens
        and chunks whose reference this one uses instead of running its own
        (the reference depends on nothing else: an evaluator whose calibrated
        layers are fitted on other tokens scores against the same logits, and
        Gemma-3-270M's 16 x 256 tokens are 2.1 GiB of them even as probs16)."""
        if reference not in REFERENCES:
            raise ValueError(f"reference must be one of {REFERENCES}, got {reference!r}")
        if same_reference is not None and (same_reference.model is not model or same_reference.chunk != max(1, chunk)
                                           or not np.array_equal(same_reference.tokens, np.asarray(tokens))):
            raise ValueError("same_reference must be an evaluator of the same model on the same tokens and chunk")
        if same_reference is not None and reference not in ("auto", same_reference.reference):
            raise ValueError(f"reference={reference!r} differs from same_reference's {same_reference.reference!r}")
        self.model = model
        self.adapter = ModelAdapter(model)
        self.sites = {s.path: s for s in self.adapter.sites}
        self.tokens = np.asarray(tokens)
        self.chunk = max(1, chunk)
        self.scale_dtype = scale_dtype
        # What quantize will also do, outside any assignment: the layers the
        # model pins (quant_predicate: MoE router gates at 8 bits...), and
        # embeddings/head at --embed-bits (:meth:`pin_outside`). Without
        # them the joint KL is not the quantized model's.
        self.pinned = {p: f"{spec['bits']}b_g{spec['group_size']}" for p, spec in self.adapter.fixed.items()}
        self.originals = {p: self.adapter.get(p) for p in [*self.sites, *self.pinned]}
        self._calibration = calibration
        # per chunk: float32 logits, or (probs16) a KLReference built from
        # them, the chunk's logits let go before the next forward
        self.reference, self.ref_logits = reference, []
        if same_reference is not None:
            self.reference, self.ref_logits = same_reference.reference, same_reference.ref_logits
        for i in range(0, len(self.tokens), self.chunk) if same_reference is None else ():
            logits = self._logits(i)
            if self.reference == "auto":
                whole = logits.nbytes // logits.shape[0] * len(self.tokens)
                self.reference = "probs16" if whole > REFERENCE_F32_LIMIT else "logits"
            if self.reference == "probs16":
                from ..kl import KLReference

                logits = KLReference(logits, form="probs16")
            self.ref_logits.append(logits)
            del logits
        if calibration is not None:
            self._layers = calibration._layers
        else:
            from .. import streaming
            from .layer_cache import LayerCache

            # 3/8 of what is left, with the block-output store's eighth
            # (_start_reuse) half: the rest is for the forward's activations
            # and the layers of the assignment in use, held while it runs
            # even when the cache has dropped them. At 8B on 24 GiB (~18 GiB
            # left with the weights on disk) that is ~6.7 GiB: two sets of
            # layers at 3.5 bpw (3.3 GiB each), so a search's current
            # allocation stays built; a dropped set costs ~95 CPU-s to
            # rebuild there (12 at 1B), under half an 8 x 256 evaluation.
            limit = streaming.memory_share(3 / 8) if layer_limit == "auto" else layer_limit
            self._layers = LayerCache(limit)
        self.evaluations = 0  # forwards run (an assignment scored before is not rerun)
        self.reused = 0  # scores returned from _scores
        self._scores: dict[tuple, np.ndarray] = {}
        self.blocks_run = self.blocks_skipped = 0  # block calls of evaluations run / stubbed
        self._prefixes, self.reuse_reason, self._after = None, "reuse_blocks=False", frozenset()
        if reuse_blocks:
            self._start_reuse(prefix_bytes)

    def _start_reuse(self, limit: int | None) -> None:
        from .. import streaming
        from .prefix import BlockOutputs, replays

        blocks = self.adapter.blocks
        if not blocks:
            self.reuse_reason = "the model has no decoder blocks the adapter knows"
            return
        # A short piece of the tokens: the check is about the model's code.
        piece = mx.array(self.tokens[:1, : min(self.tokens.shape[1], 32)])
        root = self.model if streaming.streams(self.model) else None
        outside = {p: self.originals[p] for p, s in self.sites.items() if s.block is None}
        self.reuse_reason, self._after = replays(self.model, blocks, piece, root, outside)
        if self.reuse_reason is None:
            if limit is None:
                # The layer cache takes 3/8 of the available memory (__init__):
                # this store an eighth. An 8B bf16 model's outputs are
                # 1 GiB per evaluation of 8 x 256 tokens (float32).
                limit = streaming.memory_share(1 / 8, at_most=2 << 30)
            self._prefixes = BlockOutputs(limit)

    def _logits(self, i):
        out = self._forward(mx.array(self.tokens[i : i + self.chunk])).astype(mx.float32)
        mx.eval(out)
        return out

    def _forward(self, x):
        """``model(x)``; for a model whose weights stay on disk
        (:mod:`mixbits.streaming`), one block's weights at a time."""
        from .. import streaming
        from .replay import Streamed

        blocks = self.adapter.blocks
        if not blocks or not streaming.streams(self.model):
            return self.model(x)
        originals = list(blocks)
        try:
            blocks[:] = [Streamed(b, self.model) for b in originals]
            out = self.model(x)
            mx.eval(out)
        finally:
            blocks[:] = originals
        streaming.release(self.model)
        return out

    def _forward_reusing(self, x, ci: int, sigs: list):
        """``model(x)`` for chunk ``ci``, its first blocks stubbed by the
        outputs stored under the same signatures (:mod:`.prefix`), the
        others run and their outputs stored."""
        from .. import streaming
        from .prefix import forward, well_formed

        blocks, store = self.adapter.blocks, self._prefixes
        n = len(blocks)
        start, last = 0, None
        for b in range(n - 1, -1, -1):  # the latest block whose output is stored
            last = store.get((ci, b, sigs[b]))
            if last is not None:
                start = b + 1
                break
        root = self.model if streaming.streams(self.model) else None
        out, calls = forward(self.model, blocks, x, start, last, root)
        if not well_formed(calls, start, n):
            # Not the forward the check saw: stop reusing, run it plainly.
            self._prefixes, self.reuse_reason = None, "a forward did not call the blocks as checked"
            return self._forward(x)
        self.blocks_run += len(calls)
        self.blocks_skipped += start
        for b, _, _, block_out in reversed(calls):
            store.put((ci, b, sigs[b]), block_out)
        return out

    def hessian(self, path: str, along=()):
        """(X^T X, tokens) of a tensor's input on the calibration tokens
        (this evaluator's own unless ``calibration`` was given), from a replay of the unquantized model.
        ``along``: paths asked for next, recorded in the same replay where
        they share the block (Replayer.input_hessian)."""
        from .replay import Replayer, token_chunks

        if self._calibration is not None:
            return self._calibration.hessian(path, along)
        if getattr(self, "_replayer", None) is None:
            self._replayer = Replayer(self.model, token_chunks(self.tokens, self.chunk),
                                      self.adapter, logits=False)  # X^T X only: its own reference is ref_logits
        return self._replayer.input_hessian(self.sites[path], [self.sites[p] for p in along])

    def _forget_inputs(self) -> None:
        """Let go of the replay's last recorded X^T X (one block's)."""
        if self._calibration is not None:
            return self._calibration._forget_inputs()
        if getattr(self, "_replayer", None) is not None:
            self._replayer.forget_inputs()

    def pin_outside(self, embed_bits: int | None, group_size: int = DEFAULT_GROUP_SIZE) -> dict[str, str]:
        """Embeddings and head (the tensors outside the blocks) at
        ``embed_bits`` in every evaluation, as ``quantize --embed-bits``
        stores them (16 or None: left as loaded). Returns the pins added."""
        added = {p: c.name for p, c in embed_candidates(self.model, {}, embed_bits, group_size).items()}
        self.pinned.update(added)
        return added

    def layer(self, path: str, cand_name: str, along=()):
        """The built layer of ``path`` at ``cand_name`` (cached). ``along``:
        paths whose layers are built next (their inputs recorded in the same
        replay, :meth:`hessian`)."""
        key = (path, cand_name)
        layer = self._layers.get(key)
        if layer is None:  # never built, or dropped by the cache's limit
            cand = parse_candidate(cand_name)
            site = self.sites.get(path)
            h = self.hessian(path, along) if site is not None and needs_inputs(cand, site) else None
            layer = build_layer(self.originals[path], cand, self.scale_dtype, h)
            mx.eval(layer.parameters())
            from .. import streaming

            streaming.release(self.originals[path])  # its float weight, when it stays on disk
            self._layers.put(key, layer)
        return layer

    @property
    def n_chunks(self) -> int:
        return len(self.ref_logits)

    def joint_kl(self, assignment: dict[str, str], chunks: int | None = None) -> tuple[float, float]:
        """(mean, standard error) of per-token KL with ``assignment``
        (tensor path -> candidate name; others stay as loaded), on all
        calibration chunks or the first ``chunks`` of them."""
        v = self.token_kls(assignment, chunks).ravel()
        return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0

    def sequence_kls(self, assignment: dict[str, str], chunks: int | None = None) -> np.ndarray:
        """Mean per-token KL of each sequence [n_seq] with ``assignment`` (as
        :meth:`joint_kl`; their mean is joint_kl's, sequences being equal in length)."""
        return self.token_kls(assignment, chunks).mean(axis=1)

    def token_kls(self, assignment: dict[str, str], chunks: int | None = None) -> np.ndarray:
        """Per-token KL [n_seq, seq_len] with ``assignment`` (as :meth:`joint_kl`).

        An assignment scored before on the same chunks (pins included) is
        not run again: refine's baseline guard scores the same uniform
        plans for every budget of one convert, and a search may come back
        to a plan it tried. The model's weights and tokens do not change
        under an evaluator, so the stored scores are the ones a rerun gives."""
        unknown = sorted(set(assignment) - set(self.sites))
        if unknown:
            raise ValueError(f"assignment names unknown tensors: {unknown[:5]}")
        assignment = {**self.pinned, **assignment}
        n = len(self.ref_logits) if not chunks else min(chunks, len(self.ref_logits))
        key = (frozenset(assignment.items()), n)
        if key in self._scores:
            self.reused += 1
            return self._scores[key].copy()
        # The layers to build, their calibrated linears' inputs recorded one replay per block.
        along = [p for p, c in assignment.items() if (p, c) not in self._layers and p in self.sites
                 and needs_inputs(parse_candidate(c), self.sites[p])]
        modules = {path: self.layer(path, cand, along) for path, cand in assignment.items()}
        if along:
            self._forget_inputs()  # the last block's X^T X, not held through the forwards
        out = self._kls_with(modules, n, assignment)
        self.evaluations += 1
        self._scores[key] = out
        return out.copy()

    def token_kls_of(self, modules: dict, chunks: int | None = None) -> np.ndarray:
        """Per-token KL [n_seq, seq_len] with ``modules`` ({site path: built
        layer}, e.g. another quantizer's) in place of the sites' for the
        run, put back after. Not stored: such layers have no candidate name."""
        return self._kls_with(modules, self.n_chunks if chunks is None else chunks)

    def _kls_with(self, modules: dict, n_chunks: int, assignment: dict | None = None) -> np.ndarray:
        """Per-token KL [n_seq, seq_len] of the first ``n_chunks`` chunks
        with ``modules`` (tensor path -> module) in place of the loaded ones;
        ``assignment``: the candidate names they are (every tensor not
        named stays as loaded), for reusing block outputs."""
        sigs = None
        if assignment is not None and self._prefixes is not None:
            from .prefix import signatures

            sigs = signatures(assignment, self.sites, len(self.adapter.blocks), self._after)
        try:
            for path, module in modules.items():
                self.adapter.set(path, module)
            parts = []
            starts = list(range(0, len(self.tokens), self.chunk))[:n_chunks]
            for ci, i in enumerate(starts):
                x = mx.array(self.tokens[i : i + self.chunk])
                logits = self._forward(x) if sigs is None else self._forward_reusing(x, ci, sigs)
                ref = self.ref_logits[ci]
                kl = kl_per_token(ref, logits) if isinstance(ref, mx.array) else ref.kl(logits)
                parts.append(np.array(kl, dtype=np.float64).reshape(logits.shape[0], -1))
        finally:
            for path in modules:
                self.adapter.set(path, self.originals[path])
        return np.concatenate(parts)
