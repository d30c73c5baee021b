"""Is this table (or allocation) about this model?

A sensitivity table or allocation names tensors by module path, and
models of one family share their paths: a table measured on a model four
times larger reads as if it were this model's, and a refine or compare on
it would write an allocation carrying the other model's sizes. Every
command that has both a table and the model calls :func:`check_made_for`
right after the model loads, before any work.
"""

from __future__ import annotations

from ..errors import FormatError


def _size(shape, nparams) -> str:
    return f"{'x'.join(map(str, shape))} = {nparams}" if shape else str(nparams)


def check_made_for(model, entries, source: str, *, strip_prefix: str = "") -> dict:
    """Refuse ``entries`` -- a table's ``entries`` or an allocation's
    ``assignment``: dicts (or objects) with ``path`` and ``nparams``, and
    optionally ``shape`` -- unless every path is a quantizable tensor of
    ``model`` of the same size. Raises :class:`~mixbits.errors.FormatError`
    naming ``source`` (the file), the first mismatching tensor and both
    sizes. ``strip_prefix`` is removed from the paths first (quantize's
    --strip-prefix). Returns the model's quantizable tensors {path: site}."""
    from ..adapter import ModelAdapter

    sites = {s.path: s for s in ModelAdapter(model).sites}
    for i, e in enumerate(entries):
        get = e.get if isinstance(e, dict) else lambda k, e=e: getattr(e, k, None)
        path, nparams, shape = get("path"), get("nparams"), get("shape")
        if strip_prefix and isinstance(path, str) and path.startswith(strip_prefix):
            path = path[len(strip_prefix):]
        site = sites.get(path)
        if site is None:
            raise FormatError(
                f"{source}: tensor {path!r} is not a quantizable tensor of this model (its look "
                f"like {list(sites)[:2]}); was it made for another model?")
        same = nparams == site.nparams and (shape is None or list(shape) == list(site.shape))
        if not same:
            raise FormatError(
                f"{source} was made for another model: tensor {path} is "
                f"{_size(shape, nparams)} there and {_size(site.shape, site.nparams)} in this "
                "model; measure this model (or give the model the file was made for)")
    return sites
