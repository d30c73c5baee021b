"""Calibration tokens for sweeps: text files (or a built-in corpus) cut
into equal non-overlapping sequences."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def load_texts(paths: list[str] | None, corpus: str | None) -> str:
    if paths:
        parts = []
        for p in paths:
            path = Path(p)
            if not path.is_file():
                raise FileNotFoundError(f"--text: no such file: {path}")
            parts.append(path.read_text(encoding="utf-8", errors="replace"))
        return "\n\n".join(parts)
    from ..models import calibration_text

    return calibration_text(corpus or "auto")


def token_sequences(tokenizer, text: str, n_seq: int, seq_len: int) -> np.ndarray:
    """[n_seq, seq_len] token ids from the start of ``text``."""
    if n_seq < 1 or seq_len < 2:
        raise ValueError(f"need n_seq >= 1 and seq_len >= 2, got {n_seq} and {seq_len}")
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    need = n_seq * seq_len
    if len(ids) < need:
        raise ValueError(
            f"the calibration text has {len(ids)} tokens; {n_seq} x {seq_len} = {need} are needed"
        )
    return ids[:need].reshape(n_seq, seq_len)


def add_calibration_arguments(p) -> None:
    p.add_argument("--text", nargs="+", metavar="FILE",
                   help="calibration text files (default: the built-in corpus, see --corpus)")
    p.add_argument("--corpus", choices=["auto", "botchan", "licenses"], default="auto",
                   help="built-in calibration text when --text is not given")
    p.add_argument("--n-seq", type=int, default=8, help="calibration sequences (default 8)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")


def load_model_and_tokens(args, patch: bool = True):
    from ..models import load

    model, tokenizer, _ = load(args.model)
    if patch:
        from ..nn import patch as patch_model

        patch_model(model)
    text = load_texts(args.text, args.corpus)
    return model, token_sequences(tokenizer, text, args.n_seq, args.seq_len)
