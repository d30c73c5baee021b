"""One writer per output.

Two jobs writing the same output (two ``mixbits measure`` runs with one
``--out``, two saves into one folder) would each overwrite the other's
checkpoints and both report success. :func:`output_lock` takes an
exclusive advisory lock (``fcntl.flock``) on ``<output>.lock`` beside the
output for as long as the job runs; a second job asking for the same lock
is refused at once, with the holder's pid (written into the lock file).

The lock belongs to the open file, so the kernel drops it when the process
ends however it ends: a SIGKILLed job leaves at most an unlocked
``.lock`` file, which the next job simply takes over. Locks are re-entrant
within a process (a command may lock its output early, before the model
loads, and the library function that writes it locks it again).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import inspect
import os
import threading
import time
from pathlib import Path

from .errors import OutputBusyError, OutputPathError

_held: dict[str, list] = {}  # lock file path -> [fd, depth] for the locks this process holds
_guard = threading.Lock()


def lock_path(output) -> Path:
    """The lock file of ``output``: ``<output>.lock`` beside the file it
    really names (symlinks resolved, so two names of one file share it)."""
    real = Path(os.path.realpath(output))
    return real.with_name(real.name + ".lock")


def _holder(fd: int) -> str:
    """The pid written in a held lock file (the holder writes it just after
    taking the lock: wait a moment for it)."""
    for _ in range(20):
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        if text:
            return text
        time.sleep(0.01)
    return "unknown"


def _acquire(output, lock: Path) -> int:
    try:  # as the writers do: an output's folder is made when missing
        lock.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise OutputPathError(f"cannot write {output}: a parent of it is not a folder") from None
    except OSError as e:
        raise OutputPathError(f"cannot write {output}: {e.strerror or e}") from None
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as e:
            raise OutputPathError(f"cannot write {output}: cannot create its lock {lock}: "
                                  f"{e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder(fd)
            os.close(fd)
            raise OutputBusyError(
                f"{output} is being written by another process (pid {pid}; lock {lock}); wait for it "
                "to finish or stop it, or choose another output") from None
        # A holder that was releasing may have unlinked the file we opened:
        # then the lock we got guards nothing; open the new file again.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)


def _release(lock: Path, fd: int) -> None:
    # Unlink while still holding the lock (see the samestat check above),
    # so finished jobs leave no lock files behind.
    with contextlib.suppress(OSError):
        os.unlink(lock)
    os.close(fd)


@contextlib.contextmanager
def output_lock(output):
    """Hold the exclusive lock of ``output`` (a file or folder path) for the
    ``with`` block; raise :class:`~mixbits.errors.OutputBusyError` at once,
    naming the holder's pid, if another process holds it."""
    lock = lock_path(output)
    key = str(lock)
    with _guard:
        entry = _held.get(key)
        if entry is not None:
            entry[1] += 1
        else:
            _held[key] = entry = [_acquire(output, lock), 1]
    try:
        yield lock
    finally:
        with _guard:
            entry[1] -= 1
            if entry[1] == 0:
                del _held[key]
                _release(lock, entry[0])


def locks_output(fn):
    """Decorator: ``fn`` runs holding the lock of its ``out`` argument, so a
    second job writing the same output is refused (:func:`output_lock`)."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def locked(*args, **kwargs):
        with output_lock(sig.bind(*args, **kwargs).arguments["out"]):
            return fn(*args, **kwargs)

    return locked
