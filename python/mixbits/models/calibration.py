"""Real English text for perplexity and calibration, available offline.

``botchan``: Natsume's *Botchan* (English translation, Project Gutenberg),
the test corpus inside the sentencepiece source distribution on PyPI --
prose, 4,288 lines. ``licenses``: the license texts Debian ships in
/usr/share/common-licenses (legal English; needs no download).
"""

from __future__ import annotations

import tarfile
import tempfile
from pathlib import Path

from ._cache import Unavailable, cache_dir, fetch_sdist, write_atomic

SOURCES = ("auto", "botchan", "licenses")
_SP_SDIST = ("sentencepiece", "0.2.3")
_LICENSES = Path("/usr/share/common-licenses")
_LICENSE_FILES = ("Apache-2.0", "GPL-3", "LGPL-3", "MPL-2.0", "Artistic", "GFDL-1.3", "CC0-1.0")


def botchan_path() -> Path:
    """Local copy of botchan.txt, fetched from the sentencepiece sdist once."""
    target = cache_dir() / "text" / "botchan.txt"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        sdist = fetch_sdist(*_SP_SDIST, Path(tmp))
        try:
            with tarfile.open(sdist) as tf:
                member = next((m for m in tf.getmembers() if m.name.endswith("/test/botchan.txt")), None)
                if member is None:
                    raise Unavailable(f"{sdist.name} has no test/botchan.txt")
                data = tf.extractfile(member).read()
        except tarfile.TarError as e:
            raise Unavailable(f"cannot read {sdist.name}: {e}") from None
    write_atomic(target, [data])
    return target


def _licenses_text() -> str:
    files = [_LICENSES / n for n in _LICENSE_FILES if (_LICENSES / n).is_file()]
    if not files:
        raise Unavailable(f"no license texts under {_LICENSES}")
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def calibration_text(source: str = "auto", max_chars: int | None = None) -> str:
    """English text for perplexity / sensitivity sweeps.

    ``source``: "botchan", "licenses", or "auto" (botchan, falling back to
    the license texts when it cannot be downloaded). ``max_chars`` trims
    the text. Raises :class:`Unavailable` when nothing can be had.
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if source == "licenses":
        text = _licenses_text()
    else:
        try:
            text = botchan_path().read_text(encoding="utf-8-sig")
        except Unavailable:
            if source == "botchan":
                raise
            text = _licenses_text()
    return text if max_chars is None else text[:max_chars]
