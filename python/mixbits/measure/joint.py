"""Joint KL: quantize every tensor as an assignment says, run the whole
model on calibration sequences, KL of the final logits vs the reference."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..adapter import ModelAdapter
from ..layout import DEFAULT_GROUP_SIZE
from .candidates import build_layer, embed_candidates, parse_candidate
from .sweep import kl_per_token


class JointEvaluator:
    """Holds the reference logits and a cache of quantized candidate layers,
    so trying many assignments re-quantizes each (tensor, candidate) once."""

    def __init__(self, model, tokens, chunk: int = 4, scale_dtype=mx.float16, calibration=None):
        """``calibration``: another evaluator whose tokens calibrated
        candidates (``+gptq``...) are fitted on, and whose layer cache this
        one shares -- so scoring on held-out tokens never fits on them."""
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
        self._layers: dict[tuple[str, str], object] = {} if calibration is None else calibration._layers
        self.ref_logits = [self._logits(i) for i in range(0, len(self.tokens), self.chunk)]
        self.evaluations = 0

    def _logits(self, i):
        out = self._forward(mx.array(self.tokens[i : i + self.chunk])).astype(mx.float32)
        mx.eval(out)
        return out

    def _forward(self, x):
        """``model(x)``; for a model whose weights stay on disk
        (:mod:`mixbits.streaming`), one block's weights at a time."""
        from .. import streaming
        from .replay import _Streamed

        blocks = self.adapter.blocks
        if not blocks or not streaming.streams(self.model):
            return self.model(x)
        originals = list(blocks)
        try:
            blocks[:] = [_Streamed(b, self.model) for b in originals]
            out = self.model(x)
            mx.eval(out)
        finally:
            blocks[:] = originals
        streaming.release(self.model)
        return out

    def hessian(self, path: str):
        """(X^T X, tokens) of a tensor's input on the calibration tokens
        (this evaluator's own unless ``calibration`` was given), from a replay of the unquantized model."""
        from .replay import Replayer, token_chunks

        if self._calibration is not None:
            return self._calibration.hessian(path)
        if getattr(self, "_replayer", None) is None:
            self._replayer = Replayer(self.model, token_chunks(self.tokens, self.chunk),
                                      self.adapter)
        return self._replayer.input_hessian(self.sites[path])

    def pin_outside(self, embed_bits: int | None, group_size: int = DEFAULT_GROUP_SIZE) -> dict[str, str]:
        """Embeddings and head (the tensors outside the blocks) at
        ``embed_bits`` in every evaluation, as ``quantize --embed-bits``
        stores them (16 or None: left as loaded). Returns the pins added."""
        added = {p: c.name for p, c in embed_candidates(self.model, {}, embed_bits, group_size).items()}
        self.pinned.update(added)
        return added

    def layer(self, path: str, cand_name: str):
        key = (path, cand_name)
        if key not in self._layers:
            cand = parse_candidate(cand_name)
            h = self.hessian(path) if cand.calibrated else None
            layer = build_layer(self.originals[path], cand, self.scale_dtype, h)
            mx.eval(layer.parameters())
            from .. import streaming

            streaming.release(self.originals[path])  # its float weight, when it stays on disk
            self._layers[key] = layer
        return self._layers[key]

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
        """Per-token KL [n_seq, seq_len] with ``assignment`` (as :meth:`joint_kl`)."""
        unknown = sorted(set(assignment) - set(self.sites))
        if unknown:
            raise ValueError(f"assignment names unknown tensors: {unknown[:5]}")
        assignment = {**self.pinned, **assignment}
        try:
            for path, cand in assignment.items():
                self.adapter.set(path, self.layer(path, cand))
            parts = []
            starts = list(range(0, len(self.tokens), self.chunk))[: chunks or None]
            for ci, i in enumerate(starts):
                logits = self._forward(mx.array(self.tokens[i : i + self.chunk]))
                kl = kl_per_token(self.ref_logits[ci], logits)
                parts.append(np.array(kl, dtype=np.float64).reshape(logits.shape[0], -1))
        finally:
            for path in assignment:
                self.adapter.set(path, self.originals[path])
        self.evaluations += 1
        return np.concatenate(parts)
