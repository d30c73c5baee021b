"""Model folders written whole or not at all, and checked when read.

:func:`write_folder` fills a hidden sibling temp folder, records every file
and its size in a completeness marker (``mixbits_manifest.json``), fsyncs,
and only then renames the folder into place. A save killed at any moment
leaves the previous folder (or none) under the name, never a half-written
one; the leftover ``.<name>.tmp-*`` sibling has no marker, so it does not
load. :func:`check_complete` is the reader's side: a folder with a marker
must hold exactly the files it lists, at the sizes it lists.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from .errors import FormatError, IncompleteFolderError, OutputPathError

MANIFEST = "mixbits_manifest.json"
MANIFEST_FORMAT = 1


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_replaceable(folder) -> None:
    """``folder`` may be replaced: absent, empty, or a folder we wrote. A
    folder of someone else's files is refused rather than deleted."""
    folder = Path(folder)
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise OutputPathError(f"cannot write the model folder {folder}: it exists and is not a folder")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / MANIFEST).is_file():
        raise OutputPathError(
            f"cannot write the model folder {folder}: it holds files that mixbits did not write "
            "(no mixbits_manifest.json); choose another folder or empty it"
        )


def write_folder(folder, fill) -> Path:
    """Call ``fill(tmp_dir)`` to write the folder's files into a temp folder
    beside ``folder``, add the marker, and move it into place (replacing a
    folder this function wrote before)."""
    folder = Path(folder)
    check_replaceable(folder)
    parent = folder.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=parent))
    except OSError as e:
        raise OutputPathError(f"cannot write the model folder {folder}: {e.strerror or e}") from None
    old = None
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        fill(tmp)
        files = {}
        for p in sorted(tmp.rglob("*")):
            if p.is_file():
                files[p.relative_to(tmp).as_posix()] = p.stat().st_size
                _fsync(p)
        manifest = {"format": MANIFEST_FORMAT, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
        if folder.exists():
            # Two renames: the old folder steps aside, the new one takes its
            # name. A crash between them leaves both, under hidden names.
            old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=parent))
            os.rename(folder, old / "folder")
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and (old / "folder").exists() and not folder.exists():
            os.rename(old / "folder", folder)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    _fsync(parent)
    return folder


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_complete(folder: Path, written_by_mixbits: bool) -> None:
    """Raise :class:`IncompleteFolderError` unless every file the marker
    lists is present with its recorded size. ``written_by_mixbits``
    (config.json has a "mixbits" section) makes the marker itself required;
    folders from mlx-lm or other tools have none and are not checked."""
    path = folder / MANIFEST
    if not path.is_file():
        if written_by_mixbits:
            raise IncompleteFolderError(
                f"{folder}: written by mixbits but has no {MANIFEST}: the save was interrupted "
                "(or the folder predates completeness markers; save it again)"
            )
        return
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError
        files = {str(k): int(v) for k, v in files.items()}
    except (ValueError, KeyError, TypeError, RecursionError):
        raise FormatError(f"{path}: not a valid completeness marker") from None
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise IncompleteFolderError(f"{folder}: files listed in {MANIFEST} are missing: {missing[:5]}")
    wrong = [name for name, size in files.items() if (folder / name).stat().st_size != size]
    if wrong:
        raise IncompleteFolderError(f"{folder}: files changed size since the save (truncated?): {wrong[:5]}")
