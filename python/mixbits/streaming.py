"""Weights that stay on disk until the block that uses them runs.

``mx.load`` of a safetensors file is lazy: an array reads its bytes when it
is first evaluated and holds them as long as something refers to it. A
model loaded lazily from a folder (``mixbits.load(folder, lazy=True)``)
therefore fills up to its whole size after one forward. This module lets
the commands that walk a model block by block keep only the block that
runs: :func:`attach` records, for every parameter that is a file's tensor
as it is (a name mlx-lm's ``sanitize`` left unchanged), where it came from;
:func:`release` puts fresh lazy arrays back in place of those a module has
evaluated, so their memory goes as soon as the graph that read them is
evaluated. A parameter someone replaced since (AWQ scaling, a quantized
layer, ``load_weights``) is not the one recorded and is left alone.

Releasing costs one more read of the block's bytes on its next use (the
page cache usually holds them), which the sweep's forwards dwarf.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

_SOURCE = "_mixbits_weight_source"


class _Record:
    __slots__ = ("attr", "key", "file", "dtype", "array")

    def __init__(self, attr, key, file, array):
        self.attr, self.key, self.file, self.dtype, self.array = attr, key, file, None, array


def attach(model: nn.Module, files: list[Path], sanitize=None) -> int:
    """Record where ``model``'s parameters come from in ``files`` (the
    folder's safetensors, as loaded); returns how many were recorded.
    ``sanitize``: the model's own weight transform (mlx-lm's ``sanitize``):
    a name it maps to another array is not a file's tensor as it is."""
    raw, where = {}, {}
    for f in files:
        loaded = mx.load(str(f))
        raw.update(loaded)
        where.update(dict.fromkeys(loaded, Path(f)))
    plain = raw
    if sanitize is not None:
        try:
            san = sanitize(dict(raw))
        except Exception:  # a sanitize that cannot run twice: stream nothing
            return 0
        plain = {k: v for k, v in san.items() if raw.get(k) is v}
    modules = dict(model.named_modules())
    count = 0
    for path, m in modules.items():
        for attr, v in list(m.items()):
            key = f"{path}.{attr}" if path else attr
            src = plain.get(key)
            if not isinstance(v, mx.array) or src is None:
                continue
            if tuple(src.shape) != tuple(v.shape) or src.dtype != v.dtype:
                continue
            recs = m.__dict__.setdefault(_SOURCE, [])
            recs.append(_Record(attr, key, where[key], v))
            count += 1
    return count


def streams(module: nn.Module) -> bool:
    """Whether any parameter under ``module`` is recorded (:func:`attach`)."""
    return any(m.__dict__.get(_SOURCE) for _, m in module.named_modules())


def release(module) -> None:
    """Fresh lazy arrays, read from disk when next used, for the recorded
    parameters under ``module`` that are still the arrays recorded (their
    dtype cast by :func:`cast` kept). No-op for a module that streams none."""
    if not isinstance(module, nn.Module):
        return
    todo = []
    for _, m in module.named_modules():
        recs = m.__dict__.get(_SOURCE)
        if not recs:
            continue
        keep = []
        for r in recs:
            if m.get(r.attr) is r.array:
                todo.append((m, r))
                keep.append(r)
        m.__dict__[_SOURCE] = keep  # replaced since: no longer ours to release
    by_file: dict[Path, list] = {}
    for m, r in todo:
        by_file.setdefault(r.file, []).append((m, r))
    for f, items in by_file.items():
        fresh = mx.load(str(f))  # lazy: only the header is read here
        for m, r in items:
            a = fresh[r.key]
            if r.dtype is not None:
                a = a.astype(r.dtype)
            r.array = a
            m[r.attr] = a


def cast(model: nn.Module, paths: set[str], dtype) -> set[str]:
    """Cast the recorded parameters named in ``paths`` to ``dtype``, lazily
    (each is cast again whenever :func:`release` reloads it); returns the
    names it handled, which the caller need not cast itself."""
    done = set()
    for path, m in model.named_modules():
        for r in m.__dict__.get(_SOURCE) or []:
            name = f"{path}.{r.attr}" if path else r.attr
            if name in paths and m.get(r.attr) is r.array:
                r.dtype = dtype
                r.array = r.array.astype(dtype)
                m[r.attr] = r.array
                done.add(name)
    return done


def peak_rss() -> int:
    """This process's peak resident set, bytes: VmHWM on Linux (the
    running program's own), ru_maxrss elsewhere (bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    import sys

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def available_memory() -> int | None:
    """Bytes of memory this process can still get: MemAvailable on Linux,
    the physical memory elsewhere (an upper bound); None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def memory_share(fraction: float, at_most: int | None = None, unknown: int = 1 << 30) -> int:
    """Bytes a cache may hold: ``fraction`` of :func:`available_memory` (read
    now, so after the model's weights are in), at most ``at_most``;
    ``unknown`` where the available memory cannot be read. The one rule the
    joint evaluator's caches (block outputs, built layers) size themselves by."""
    avail = available_memory()
    if not avail:
        return int(unknown)
    share = int(avail * fraction)
    return share if at_most is None else min(int(at_most), share)


def peak_line() -> str:
    """``peak memory 3.12 GiB`` (resident set), the line long commands end with."""
    return f"peak memory {peak_rss() / 2 ** 30:.2f} GiB"
