"""Hugging Face repo ids, found the way mlx-lm finds them.

``mixbits convert --model Qwen/Qwen3-0.6B`` (and every other command that
takes ``--model``) resolves a repo id with mlx-lm's own resolver: the local
hub cache first (``mlx_lm.utils.hf_repo_to_path``, which honours
HF_HOME / HF_HUB_CACHE and HF_HUB_OFFLINE as the hub client does), then a
download of the files mlx-lm itself fetches (its DEFAULT_ALLOW_PATTERNS).
"""

from __future__ import annotations

import re
from pathlib import Path

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(spec) -> bool:
    """``owner/name`` that is not a local path."""
    return isinstance(spec, str) and bool(_REPO_ID.match(spec)) and not Path(spec).exists()


def snapshot(repo_id: str) -> Path:
    """The local folder of ``repo_id``: the cached snapshot, else downloaded.
    FileNotFoundError (naming the cache and HF_HUB_OFFLINE) when neither works."""
    import os

    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS, hf_repo_to_path, snapshot_download

    try:
        return Path(hf_repo_to_path(repo_id))
    except Exception as cached_error:  # the hub client's "not in the cache" errors vary by version
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
            raise FileNotFoundError(
                f"model {repo_id!r}: not a local path, and not in the Hugging Face cache "
                f"(HF_HUB_OFFLINE is set, so nothing is downloaded): {cached_error}") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as e:
        raise FileNotFoundError(f"model {repo_id!r}: not a local path, and the Hugging Face hub "
                                f"could not provide it: {e}") from None
