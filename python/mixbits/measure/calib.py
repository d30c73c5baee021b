"""Calibration tokens for sweeps: text files (or a built-in corpus) cut
into equal non-overlapping sequences, or token ids given directly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

DTYPES = ("float32", "float16", "bfloat16")


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


def load_tokens(path) -> np.ndarray:
    """Token ids [n_seq, seq_len] from a .npy file or a JSON list of lists."""
    from ..errors import UsageError

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--tokens: no such file: {path}")
    try:
        if path.suffix == ".npy":
            arr = np.load(path, allow_pickle=False)
        elif path.suffix == ".json":
            arr = np.asarray(json.loads(path.read_text()))
        else:
            raise ValueError(f"--tokens {path}: expected a .npy or .json file")
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--tokens {path}: unreadable ({e})") from None
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 2:
        raise ValueError(f"--tokens {path}: expected int ids of shape [n_seq, seq_len >= 2], "
                         f"got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"--tokens {path}: expected integer token ids, got {arr.dtype}")
    if arr.min() < 0:
        raise ValueError(f"--tokens {path}: negative token id {int(arr.min())}")
    return arr.astype(np.int64)


def add_calibration_arguments(p) -> None:
    p.add_argument("--text", nargs="+", metavar="FILE",
                   help="calibration text files (default: the built-in corpus, see --corpus)")
    p.add_argument("--tokens", metavar="FILE",
                   help="calibration token ids instead of text: .npy or .json, int [n_seq, seq_len] "
                        "(no tokenizer needed; --n-seq/--seq-len are taken from its shape)")
    p.add_argument("--corpus", choices=["auto", "botchan", "licenses"], default="auto",
                   help="built-in calibration text when --text is not given")
    p.add_argument("--n-seq", type=int, default=8, help="calibration sequences (default 8)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    add_dtype_argument(p)


def add_dtype_argument(p, why: str = "") -> None:
    """``--dtype``: what measure, refine and quantize's calibrated layers run the model in."""
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="dtype the model's float weights and activations run in (default float32: "
                        "on the CPU the mixbits attention and SwiGLU kernels take float32 only, so "
                        "half precision runs MLX's slower ops; quantized scales are kept)" + why)


def check_calibration_arguments(args):
    """Everything about the calibration set that can be checked before the
    model loads; returns the token ids when --tokens gives them."""
    from ..errors import UsageError

    if getattr(args, "text", None) and getattr(args, "tokens", None):
        raise UsageError("give --text or --tokens, not both")
    if getattr(args, "tokens", None):
        return load_tokens(args.tokens)
    if args.n_seq < 1:
        raise UsageError(f"--n-seq must be >= 1, got {args.n_seq}")
    if args.seq_len < 2:
        raise UsageError(f"--seq-len must be >= 2, got {args.seq_len}")
    for p in getattr(args, "text", None) or []:
        if not Path(p).is_file():
            raise UsageError(f"--text: no such file: {p}")
    return None


def cast_model(model, dtype: str) -> None:
    """Cast the model's float weights (not quantization scales/biases,
    whose dtype is part of the quantized format) to ``dtype``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from .. import streaming

    dt = getattr(mx, dtype)
    quantized = {p for p, m in model.named_modules() if "scales" in m}
    new = []
    for k, v in tree_flatten(model.parameters()):
        owner, _, leaf = k.rpartition(".")
        if owner in quantized and leaf in ("scales", "biases"):
            continue
        if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dt:
            new.append((k, v))
    if streaming.streams(model):  # weights on disk: cast as each is read, nothing evaluated now
        done = streaming.cast(model, {k for k, _ in new}, dt)
        rest = [(k, v.astype(dt)) for k, v in new if k not in done]
        if rest:
            model.load_weights(rest, strict=False)
        return
    if new:
        model.load_weights([(k, v.astype(dt)) for k, v in new], strict=False)
        mx.eval(model.parameters())


def load_model(args, patch: bool = True):
    """(model, tokenizer) of ``args.model`` as the sweep runs it: float
    weights cast to ``args.dtype``, quantized layers on mixbits kernels
    (``patch``)."""
    from ..models import load

    # Lazily: the weights stay on disk until a block runs (mixbits.streaming).
    model, tokenizer, _ = load(args.model, lazy=True)
    cast_model(model, getattr(args, "dtype", "float32"))
    if patch:
        from ..nn import patch as patch_model

        patch_model(model)
    return model, tokenizer


def calibration_tokens(args, model, tokenizer, tokens=None) -> np.ndarray:
    """Token ids [n_seq, seq_len]: ``tokens`` (--tokens already read), else
    --tokens, else cut from --text / the built-in corpus with ``tokenizer``;
    checked against the model's vocabulary."""
    if tokens is None:
        tokens = check_calibration_arguments(args)
    if tokens is None:
        if tokenizer is None:
            raise ValueError(f"{args.model} has no tokenizer: give calibration ids with --tokens")
        tokens = token_sequences(tokenizer, load_texts(args.text, args.corpus), args.n_seq, args.seq_len)
    vocab = _vocab_size(model)
    if vocab is not None and tokens.max() >= vocab:
        raise ValueError(f"token id {int(tokens.max())} is outside the model's vocabulary ({vocab})")
    return tokens


def load_model_and_tokens(args, patch: bool = True):
    tokens = check_calibration_arguments(args)  # a bad --tokens file fails before the model loads
    model, tokenizer = load_model(args, patch)
    return model, calibration_tokens(args, model, tokenizer, tokens)


def _vocab_size(model):
    from ..adapter import ModelAdapter

    emb = [s for s in ModelAdapter(model).sites if s.form == "embedding"]
    return emb[0].shape[0] if emb else None
