"""SentencePiece-style GGUF vocabularies (``tokenizer.ggml.model ==
"llama"``: llama 1/2, Gemma, Mistral...) as a ``tokenizers`` BPE model.

llama.cpp tokenizes these by starting from single characters and
repeatedly merging the adjacent pair whose concatenation is the
highest-scoring vocabulary piece; characters with no piece fall back to
``<0xXX>`` byte tokens. That is BPE whose merges are ranked by the score
of the merged piece, so the merges are derived here from the vocabulary
and scores: every split of every normal piece into two pieces that are
both in the vocabulary. Spaces become "▁"; with ``add_space_prefix`` each
run of plain text (after a special token, too, as llama.cpp does) gets a
leading "▁".
"""

from __future__ import annotations

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"


def merges_from_scores(tokens: list, scores: list, types: list) -> list:
    """(left, right) merges ordered by the score of their result, best first
    (ties: lower id first, then the shorter left part)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] != _NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build(meta: dict, tokens: list, types: list):
    """A ``tokenizers.Tokenizer`` for an SPM GGUF vocabulary (no added tokens yet)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges_from_scores(tokens, scores, types),
        unk_token=tokens[int(unk)] if unk is not None else None,
        byte_fallback=True,
        fuse_unk=True,
    )
    tk = Tokenizer(model)
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(SPACE)] if add_prefix else []
    tk.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPACE)])
    dec = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(dec)
    return tk
