"""Does a model's config describe its weights?

mlx-lm builds a model from config.json and loads the weights without
comparing shapes (``strict=False``, which mixbits' own layers need), so a
config whose head counts are wrong loads fine and fails at the first
forward, inside MLX's rope, without naming config.json.
:func:`check_attention_heads` compares each attention module's head
counts with its projections right after the load.
"""

from __future__ import annotations

import mlx.nn as nn

from .errors import FormatError

_HEADS = ("n_heads", "num_heads", "num_attention_heads")
_KV_HEADS = ("n_kv_heads", "num_kv_heads", "num_key_value_heads")


def _int_attr(m, names):
    for n in names:
        v = getattr(m, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def check_attention_heads(model, source: str) -> None:
    """Raise :class:`FormatError` naming ``source`` (the config) when an
    attention module's q_proj (k_proj) rows are not a whole multiple of its
    heads (key-value heads) x head_dim -- a multiple, not equal, since some
    architectures stack a gate with the queries. Modules without these
    attributes are not checked."""
    from .adapter import weight_shape

    for path, m in model.named_modules():
        heads, head_dim = _int_attr(m, _HEADS), _int_attr(m, ("head_dim",))
        if heads is None or head_dim is None:
            continue
        for proj, n, key in (("q_proj", heads, "num_attention_heads"),
                             ("k_proj", _int_attr(m, _KV_HEADS), "num_key_value_heads")):
            child = m.get(proj) if isinstance(m, dict) else None
            if n is None or not isinstance(child, nn.Module):
                continue
            try:
                rows = weight_shape(child)[-2]
            except (KeyError, ValueError, IndexError, AttributeError):
                continue  # not a plain projection: nothing to compare
            if rows % (n * head_dim):
                raise FormatError(
                    f"{source} does not describe these weights: {path} has {n} heads of head_dim "
                    f"{head_dim} ({key}, head_dim) but {path}.{proj} has {rows} output rows, not a "
                    f"multiple of {n * head_dim}; use the model's own config.json")
