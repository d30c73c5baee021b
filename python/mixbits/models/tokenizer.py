"""A tokenizer rebuilt from a GGUF's vocabulary -- byte-level BPE
(``tokenizer.ggml.model == "gpt2"``, from its merges) or SentencePiece
(``"llama"``, see :mod:`.tokenizer_spm`) -- and read back from / written
to a model folder (tokenizer.json + tokenizer_config.json, the files
``mlx_lm.load`` / transformers read).

Uses only the ``tokenizers`` package. Byte-level BPE pre-tokenizers by
GGUF ``tokenizer.ggml.pre``: the StarCoder family (SmolLM uses it) splits
digits one by one, then GPT-2's byte-level regex; llama-3 and Qwen2 split
with their own regexes (digits in runs of up to 3 / one by one); the same
rules llama.cpp applies for these models.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import tokenizer_spm

# GGUF token types (llama.cpp's enum): 1 normal, 2 unknown, 3 control,
# 4 user-defined, 5 unused, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_PLAIN_GPT2_PRE = {"gpt2", "default", "mpt", "olmo", "jais"}
# Regex splits (then byte-level mapping) of the llama-3 and Qwen2 families;
# they differ only in how many digits one piece may hold.
_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}%s| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_REGEX_PRE = {"llama-bpe": _SPLIT % "{1,3}", "llama3": _SPLIT % "{1,3}", "qwen2": _SPLIT % "", "deepseek-r1-qwen": _SPLIT % ""}


class Tokenizer:
    """encode/decode plus the ids generation needs; saves to a model folder."""

    def __init__(self, tk, *, eos_token_ids, bos_token_id=None, add_bos=False, special=None, chat_template=None):
        self.tk = tk
        self.eos_token_ids = sorted(set(int(i) for i in eos_token_ids))
        self.bos_token_id = bos_token_id
        self.add_bos = bool(add_bos)
        self.special = dict(special or {})  # role -> token text
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=False)

    # ------------------------------------------------------------ files

    def save(self, folder) -> None:
        folder = Path(folder)
        self.tk.save(str(folder / "tokenizer.json"))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            **{f"{role}_token": tok for role, tok in self.special.items()},
        }
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))

    @classmethod
    def from_folder(cls, folder, eos_token_ids=None) -> "Tokenizer":
        from tokenizers import Tokenizer as _Tk

        from ..formats.errors import FormatError, expect_dict, load_json

        folder = Path(folder)
        path = folder / "tokenizer.json"
        try:
            tk = _Tk.from_file(str(path))
        except Exception as e:  # the tokenizers library raises bare Exceptions
            raise FormatError(f"{path}: not a tokenizer the tokenizers library can read ({e}); "
                              "put the model's own tokenizer.json there") from None
        cfg_path = folder / "tokenizer_config.json"
        cfg = (expect_dict(load_json(cfg_path, "tokenizer_config.json"), str(cfg_path))
               if cfg_path.exists() else {})
        special = {}
        for role in ("bos", "eos", "unk", "pad"):
            tok = cfg.get(f"{role}_token")
            if isinstance(tok, dict):
                tok = tok.get("content")
            if tok is not None:
                special[role] = tok
        if eos_token_ids is None:
            eos_token_ids = [tk.token_to_id(special["eos"])] if "eos" in special else []
        bos = tk.token_to_id(special["bos"]) if "bos" in special else None
        return cls(
            tk,
            eos_token_ids=[i for i in eos_token_ids if i is not None],
            bos_token_id=bos,
            add_bos=cfg.get("add_bos_token", False),
            special=special,
            chat_template=cfg.get("chat_template"),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        """Build from ``tokenizer.ggml.*`` keys (``mx.load(..., return_metadata=True)``)."""
        from tokenizers import AddedToken, processors

        kind = str(meta.get("tokenizer.ggml.model", ""))
        if kind not in ("gpt2", "llama"):
            raise ValueError(f"GGUF tokenizer {kind!r} is not supported (byte-level BPE 'gpt2' and "
                             "SentencePiece 'llama' are)")
        tokens = list(meta["tokenizer.ggml.tokens"])
        types = [int(t) for t in _as_list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))]
        tk = _bpe(meta, tokens) if kind == "gpt2" else tokenizer_spm.build(meta, tokens, types)
        specials = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _CONTROL]
        users = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _USER_DEFINED]
        if specials:
            tk.add_special_tokens(specials)
        if users:
            tk.add_tokens(users)

        def tid(key):
            v = meta.get(f"tokenizer.ggml.{key}_token_id")
            return None if v is None else int(_scalar(v))

        ids = {role: tid(role) for role in ("bos", "eos", "unknown", "padding")}
        names = {"bos": "bos", "eos": "eos", "unknown": "unk", "padding": "pad"}
        special = {names[r]: tokens[i] for r, i in ids.items() if i is not None}
        add_bos = bool(_scalar(meta.get("tokenizer.ggml.add_bos_token", False)))
        if add_bos and ids["bos"] is not None:
            # Saved with the folder: transformers / mlx_lm.load then add BOS
            # as llama.cpp does (our encode adds it itself, without this).
            bos = tokens[ids["bos"]]
            tk.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ids["bos"])])
        template = meta.get("tokenizer.chat_template")
        return cls(
            tk,
            eos_token_ids=[ids["eos"]] if ids["eos"] is not None else [],
            bos_token_id=ids["bos"],
            add_bos=add_bos,
            special=special,
            chat_template=str(template) if template is not None else None,
        )


def _bpe(meta: dict, tokens: list):
    """Byte-level BPE (GPT-2 style) from the GGUF's tokens and merges."""
    from tokenizers import Regex
    from tokenizers import Tokenizer as _Tk
    from tokenizers import decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    pre = str(meta.get("tokenizer.ggml.pre", "gpt2"))
    known = _DIGIT_SPLIT_PRE | _PLAIN_GPT2_PRE | set(_REGEX_PRE)
    if pre not in known:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (known: {sorted(known)})")
    tk = _Tk(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=pre not in _REGEX_PRE)
    if pre in _REGEX_PRE:
        split = pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated", invert=False)
        tk.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre in _DIGIT_SPLIT_PRE:
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tk.pre_tokenizer = byte_level
    tk.decoder = decoders.ByteLevel()
    return tk


def _scalar(v):
    try:
        return v.item()
    except AttributeError:
        return v


def _as_list(v):
    try:
        return v.tolist()
    except AttributeError:
        return list(v)
