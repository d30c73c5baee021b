"""The ``quantization`` block of an mlx-lm ``config.json``, with per-path
overrides::

    "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                     "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 6},
                     "lm_head": false}

mlx-lm's loader calls ``nn.quantize`` with a class predicate that returns
``config["quantization"][path]`` when the module path is a key: a dict
(that module's own group_size/bits[/mode]) or a boolean (``false`` leaves
the module unquantized). Writers copy the same block to
``"quantization_config"`` (Hugging Face tooling looks there), and so does
:func:`write_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..layout import DEFAULT_GROUP_SIZE

from .errors import (
    FormatError,
    at,
    expect_dict,
    expect_int,
    expect_str,
    load_json,
    write_json_atomic,
)

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)
_SCALAR_KEYS = ("group_size", "bits", "mode")


def _check_quant(d: dict, where: str, required: bool) -> dict:
    out = {}
    for k in ("group_size", "bits"):
        if k in d:
            out[k] = expect_int(d[k], at(where, k), lo=1)
        elif required:
            raise FormatError(f"{where}: missing key {k!r}")
    if "mode" in d:
        out["mode"] = expect_str(d["mode"], at(where, "mode"))
    if out.get("mode", "affine") == "affine":
        if "bits" in out and out["bits"] not in AFFINE_BITS:
            raise FormatError(f"{at(where, 'bits')}: unknown bit width {out['bits']}; affine takes {AFFINE_BITS}")
        if "group_size" in out and out["group_size"] not in AFFINE_GROUP_SIZES:
            raise FormatError(
                f"{at(where, 'group_size')}: {out['group_size']} is not one of {AFFINE_GROUP_SIZES}"
            )
    return out


@dataclass
class MlxQuantization:
    """Default group_size/bits/mode plus per-module-path overrides."""

    group_size: int = DEFAULT_GROUP_SIZE
    bits: int = 4
    mode: str | None = "affine"  # None: the block had no "mode" key
    overrides: dict[str, dict | bool] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # other scalar keys, kept as-is

    @classmethod
    def from_block(cls, block, where: str = "quantization") -> "MlxQuantization":
        block = expect_dict(block, where)
        base = _check_quant(block, where, required=True)
        overrides, extra = {}, {}
        for k, v in block.items():
            if k in _SCALAR_KEYS:
                continue
            if isinstance(v, bool):
                overrides[k] = v
            elif isinstance(v, dict):
                q = _check_quant(v, at(where, k), required=True)
                overrides[k] = {**v, **q}
            else:
                extra[k] = v
        return cls(base["group_size"], base["bits"], base.get("mode"), overrides, extra)

    def to_block(self) -> dict:
        out = {"group_size": self.group_size, "bits": self.bits}
        if self.mode is not None:
            out["mode"] = self.mode
        out.update(self.extra)
        out.update(self.overrides)
        return out

    def for_path(self, path: str) -> dict | bool:
        """What mlx-lm would quantize ``path`` with: the override if any,
        else the defaults."""
        if path in self.overrides:
            return self.overrides[path]
        out = {"group_size": self.group_size, "bits": self.bits}
        if self.mode is not None:
            out["mode"] = self.mode
        return out

    def set_override(self, path: str, bits: int, group_size: int, mode: str | None = None) -> None:
        q = {"group_size": group_size, "bits": bits}
        if mode is not None:
            q["mode"] = mode
        _check_quant(q, at("quantization", path), required=True)
        self.overrides[path] = q


def read_config(source) -> tuple[dict, MlxQuantization | None]:
    """``(config, quantization)`` from a config.json path or dict. The block
    is read from ``"quantization"``, else ``"quantization_config"``; None if
    neither is present (an unquantized model)."""
    cfg = expect_dict(load_json(source, "config.json"), "config")
    for key in ("quantization", "quantization_config"):
        if key in cfg:
            return cfg, MlxQuantization.from_block(cfg[key], key)
    return cfg, None


def mixbits_layers(config: dict, where: str = "config.json", required: bool = False) -> dict:
    """config.json's ``"mixbits": {"layers": {...}}``: the layers only
    mixbits can build. Absent is {} (a stock folder) unless ``required``."""
    section = config.get("mixbits")
    if section is None and not required:
        return {}
    layers = section.get("layers", None if required else {}) if isinstance(section, dict) else None
    if not isinstance(layers, dict):
        raise FormatError(f"{where}: 'mixbits' must be an object with a 'layers' object")
    return layers


def with_quantization(config: dict, q: MlxQuantization) -> dict:
    """A copy of ``config`` carrying ``q`` under both keys mlx-lm writes."""
    out = dict(expect_dict(config, "config"))
    block = q.to_block()
    out["quantization"] = block
    out["quantization_config"] = dict(block)
    return out


def write_config(path, config: dict, q: MlxQuantization) -> None:
    write_json_atomic(with_quantization(config, q), path, indent=4)


def from_allocation(alloc, group_size: int = DEFAULT_GROUP_SIZE, default_bits: int | None = None) -> MlxQuantization:
    """mlx-lm overrides for an :class:`~mixbits.formats.allocation.Allocation`:
    every tensor at its chosen bits with ``group_size``; the default bits is
    the most common choice unless given. A ternary choice has no mlx-lm
    affine equivalent and is rejected (mixbits' own loader handles it)."""
    from collections import Counter

    for i, e in enumerate(alloc.assignment):
        if not e.kind.isdigit():
            raise ValueError(
                f"assignment[{i}] ({e.path}): kind {e.kind!r} cannot be written as an mlx-lm affine override"
            )
    counts = Counter(e.bits for e in alloc.assignment)
    base = default_bits if default_bits is not None else counts.most_common(1)[0][0]
    q = MlxQuantization(group_size=group_size, bits=base, mode="affine")
    _check_quant(q.to_block(), "quantization", required=True)
    for e in alloc.assignment:
        if e.bits != base:
            q.set_override(e.path, e.bits, group_size)
    return q
