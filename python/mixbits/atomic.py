"""Crash-safe file replacement, used by every writer in the package: a
reader never sees a half-written file, and a job killed at any moment
leaves either the old version or the new one."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

from .errors import OutputPathError


def output_target(path) -> Path:
    """The file an output named ``path`` really goes to, checked first.

    A symlink is written *through*: its target gets the new content (the
    link itself stays, as with ``open(path, "w")``), replaced atomically in
    the target's own folder. Anything that is not a regular file -- a
    directory, a device node, a FIFO, a socket -- is refused: replacing it
    by a file would destroy it. Raises :class:`OutputPathError`."""
    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return target
    except NotADirectoryError:
        raise OutputPathError(f"cannot write {path}: a parent of it is not a folder") from None
    except OSError as e:
        raise OutputPathError(f"cannot write {path}: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise OutputPathError(f"cannot write {path}: it is a directory (give a file name)")
    if not stat.S_ISREG(st.st_mode):
        raise OutputPathError(f"cannot write {path}: it exists and is not a regular file")
    return target


def _temp_beside(path: Path) -> str:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Keep the suffix: some writers (mx.save_safetensors) append one otherwise.
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    except (FileExistsError, NotADirectoryError):
        raise OutputPathError(f"cannot write {path}: a parent of it is not a folder") from None
    except OSError as e:
        raise OutputPathError(f"cannot write {path}: {e.strerror or e}") from None
    os.close(fd)
    return tmp


def replace_atomic(path, write) -> None:
    """Call ``write(tmp_path)`` on a temp file beside ``path``, fsync it,
    ``os.replace`` it over ``path``, then fsync the folder so the rename
    itself survives a power cut. ``path`` goes through :func:`output_target`
    first (symlinks written through, non-regular files refused)."""
    path = output_target(path)
    tmp = _temp_beside(path)
    try:
        # mkstemp makes the file private (0600); give it the mode a plain
        # open() would, so results are as readable as any other output.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_json_atomic(obj, path, indent: int | None = 2, allow_nan: bool = False) -> None:
    """``obj`` as JSON to ``path``, atomically. NaN/inf are refused unless
    ``allow_nan`` (they are not JSON; Python's reader accepts them)."""
    text = json.dumps(obj, indent=indent, allow_nan=allow_nan) + "\n"

    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    replace_atomic(path, write)
