"""Model folders written whole or not at all, and checked when read.

:func:`write_folder` fills a hidden sibling temp folder, records every file
and its size in a completeness marker (``mixbits_manifest.json``), fsyncs,
and only then renames the folder into place. A save killed at any moment
leaves the previous folder (or none) under the name, never a half-written
one; the leftover ``.<name>.tmp-<pid>-*`` sibling has no marker, so it
does not load, and the next save to the same place removes it (with a
warning naming it). Saves hold the folder's lock
(:func:`mixbits.lock.output_lock`): two at once into one folder are
refused, and a temp folder found under the lock belongs to no running
save. :func:`check_complete` is the reader's side: a folder with a marker
must hold exactly the files it lists, at the sizes it lists.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import time
import warnings
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


class LeftoverWarning(UserWarning):
    """Files left by an interrupted save were removed."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_leftovers(folder) -> list[str]:
    """Remove the temp folders (``.<name>.tmp-<pid>-*``) that killed saves
    of ``folder`` left beside it, warning with their names; returns them.
    Only those whose creating process is gone (a save from an older
    mixbits, whose names carry no pid: only after an hour); call it holding
    the folder's lock, so that no save of ours to it is running."""
    folder = Path(folder)
    prefix = f".{folder.name}.tmp-"
    try:
        found = [p for p in folder.parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return []
    removed = []
    for p in sorted(found):
        if p.is_symlink() or not p.is_dir():
            continue
        pid = p.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and _alive(int(pid)):
            continue
        if not pid.isdigit() and time.time() - p.stat().st_mtime < 3600:
            continue
        shutil.rmtree(p, ignore_errors=True)
        if not p.exists():
            removed.append(p.name)
    if removed:
        warnings.warn(LeftoverWarning(f"removed {len(removed)} temp folder(s) that interrupted saves of "
                                      f"{folder} left in {folder.parent}: {', '.join(removed[:5])}"),
                      stacklevel=2)
    return removed


def write_folder(folder, fill) -> Path:
    """Call ``fill(tmp_dir)`` to write the folder's files into a temp folder
    beside ``folder``, add the marker, and move it into place (replacing a
    folder this function wrote before). Holds ``folder``'s lock meanwhile,
    and first removes what killed saves to it left (:func:`remove_leftovers`)."""
    from .lock import output_lock

    folder = Path(folder)
    check_replaceable(folder)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputPathError(f"cannot write the model folder {folder}: {e.strerror or e}") from None
    with output_lock(folder):
        remove_leftovers(folder)
        return _write_folder(folder, fill)


def _write_folder(folder: Path, fill) -> Path:
    check_replaceable(folder)
    parent = folder.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        # The pid in the name: remove_leftovers spares the folders of live saves.
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-{os.getpid()}-", dir=parent))
    except OSError as e:
        raise OutputPathError(f"cannot write the model folder {folder}: {e.strerror or e}") from None
    old = None
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        try:
            fill(tmp)
        except (OSError, RuntimeError) as e:
            raise _write_error(folder, tmp, e) from None
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


def _write_error(folder: Path, tmp: Path, e: BaseException) -> BaseException:
    """A failed write while filling ``tmp`` as an error naming the folder
    and, when the disk is (nearly) full, saying so: MLX's own message is
    only '[write] Unable to write N bytes to file.'"""
    if isinstance(e, OutputPathError) or (isinstance(e, RuntimeError) and "write" not in str(e).lower()):
        return e
    try:
        free = shutil.disk_usage(tmp).free
    except OSError:
        free = None
    full = getattr(e, "errno", None) == errno.ENOSPC or (free is not None and free < 16 << 20)
    where = f"{tmp.parent}'s disk"
    said = (f"no space left on {where} ({free / 2**20:.0f} MiB free)" if full and free is not None
            else "no space left on the device" if full
            else f"{free / 2**20:.0f} MiB free on {where}" if free is not None else "")
    what = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return OutputPathError(f"cannot write the model folder {folder}: {what}" + (f"; {said}" if said else ""))


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
    # The folder is exactly its marker: weight files it does not list (an
    # old save's, a copy) would be globbed and merged over the saved ones.
    stray = sorted(p.name for p in folder.glob("model*.safetensors") if p.name not in files)
    if stray:
        raise FormatError(f"{folder}: {stray[:5]} are not listed in its {MANIFEST} (left by another save, "
                          "or copied in); loading would merge them into the saved weights: move them out "
                          "of the folder")
