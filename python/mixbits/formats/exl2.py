"""ExLlamaV2 ``measurement.json``: typed objects, checks, and the map from an
EXL2 option to mixbits K-segments.

File layout (ExLlamaV2 writes it after its measurement pass)::

    {"measurement": {
        "model.layers.0.self_attn": [option, ...],
        "model.layers.0.mlp": [option, ...],
        ...,
        "model.norm.norm": null, "lm_head.linear": null},
     "last_module_idx": 98}

    option = {"accuracy": 0.957, "total_bits": 80752640,
              "q_proj": {"group_size": {"3": 64, "2": 64}, "bits": [3, 2],
                         "bits_prop": [0.05, 0.95], "scale_bits": 4}, ...}

``accuracy`` is 1 - mean relative error of the module output; ``total_bits``
is the storage of all projections of the module under ExLlamaV2's count
(:meth:`ProjectionQuant.total_bits`). Keys this module does not know are kept
and written back, so ``save(load(f))`` is JSON-equal to ``f``.

Shapes follow ExLlamaV2's convention: a projection is K rows (inputs) by
N columns (outputs); ``bits_prop`` splits the K rows.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .errors import (
    FormatError,
    at,
    expect_dict,
    expect_int,
    expect_list,
    expect_number,
    load_json,
    require,
    write_json_atomic,
)

EXL2_BITS = (2, 3, 4, 5, 6, 8)
SEGMENT_GROUP_SIZES = (32, 64, 128)  # what mixbits segments support
_PROP_SUM_TOL = 1e-6
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(key: str) -> int | None:
    """The layer index in a module path (``model.layers.12.mlp`` -> 12)."""
    m = _LAYER_RE.search(key)
    return int(m.group(1)) if m else None


@dataclass
class ProjectionQuant:
    """One projection's EXL2 quantization: widths, row proportions, groups."""

    bits: tuple[int, ...]
    bits_prop: tuple[float, ...]
    group_size: dict[int, int]  # bits -> group size
    scale_bits: int
    extra: dict = field(default_factory=dict)
    group_size_scalar: bool = False  # the file gave one int for all widths

    @classmethod
    def from_dict(cls, d, where: str) -> "ProjectionQuant":
        d = expect_dict(d, where)
        bits_raw = expect_list(require(d, "bits", where), at(where, "bits"))
        if not bits_raw:
            raise FormatError(f"{at(where, 'bits')}: expected at least one width, got []")
        bits = []
        for i, b in enumerate(bits_raw):
            w = f"{at(where, 'bits')}[{i}]"
            b = expect_int(b, w)
            if b not in EXL2_BITS:
                raise FormatError(f"{w}: unknown bit width {b!r}; EXL2 widths are {EXL2_BITS}")
            if b in bits:
                raise FormatError(f"{w}: width {b} appears twice")
            bits.append(b)
        props_raw = expect_list(require(d, "bits_prop", where), at(where, "bits_prop"))
        if len(props_raw) != len(bits):
            raise FormatError(
                f"{at(where, 'bits_prop')}: {len(props_raw)} proportions for {len(bits)} widths"
            )
        props = tuple(
            expect_number(p, f"{at(where, 'bits_prop')}[{i}]", lo=0.0, hi=1.0)
            for i, p in enumerate(props_raw)
        )
        if abs(sum(props) - 1.0) > _PROP_SUM_TOL:
            raise FormatError(f"{at(where, 'bits_prop')}: proportions sum to {sum(props)!r}, not 1")
        gs_raw = require(d, "group_size", where)
        gw = at(where, "group_size")
        scalar = not isinstance(gs_raw, dict)
        if scalar:
            g = expect_int(gs_raw, gw, lo=1)
            group_size = {b: g for b in bits}
        else:
            group_size = {}
            for k, g in gs_raw.items():
                try:
                    b = int(k)
                except ValueError:
                    raise FormatError(f"{gw}: key {k!r} is not a bit width") from None
                if str(b) != k:
                    raise FormatError(f"{gw}: key {k!r} is not a canonical bit width")
                if b not in bits:
                    raise FormatError(f"{at(gw, k)}: width {b} is not in bits {bits}")
                group_size[b] = expect_int(g, at(gw, k), lo=1)
            for b in bits:
                if b not in group_size:
                    raise FormatError(f"{gw}: missing key {str(b)!r} for width {b}")
        scale_bits = expect_int(require(d, "scale_bits", where), at(where, "scale_bits"), lo=1)
        extra = {k: v for k, v in d.items() if k not in ("bits", "bits_prop", "group_size", "scale_bits")}
        return cls(tuple(bits), props, group_size, scale_bits, extra, scalar)

    def to_dict(self) -> dict:
        if self.group_size_scalar:
            gs = self.group_size[self.bits[0]]
        else:
            gs = {str(b): g for b, g in self.group_size.items()}
        return {"group_size": gs, "bits": list(self.bits), "bits_prop": list(self.bits_prop),
                "scale_bits": self.scale_bits, **self.extra}

    # ------------------------------------------------------------ sizes

    def row_split(self, k_rows: int) -> list[tuple[int, int, int]]:
        """ExLlamaV2's split of K rows: ``[(bits, groups, rows), ...]``.

        Width b gets ``groups_b = ceil(min(K*prop_b, remaining) / gs_b)`` whole
        groups, i.e. its share rounded *up* to a group; ``rows_b`` is that
        clipped to the rows still left, so the last width may end in a partial
        group. (When an earlier width's rounding already used every row,
        later widths get 0 groups; ExLlamaV2 would count negative groups
        there, a degenerate case no real option hits.)
        """
        out, remaining = [], k_rows
        for b, p in zip(self.bits, self.bits_prop):
            gs = self.group_size[b]
            groups = max(0, math.ceil(min(k_rows * p, remaining) / gs))
            rows = min(groups * gs, remaining)
            remaining -= rows
            out.append((b, groups, rows))
        if remaining > 0:
            raise FormatError(f"bits_prop {self.bits_prop} leave {remaining} of {k_rows} rows uncovered")
        return out

    def total_bits(self, k_rows: int, n_cols: int) -> int:
        """ExLlamaV2's storage count for a K x N projection: quantized weights
        (rows_b * N * b), per group a 16-bit max scale and a 32-bit group
        record, ``scale_bits`` per group and column, and a 32-bit row
        permutation entry per input row."""
        split = self.row_split(k_rows)
        groups = sum(g for _, g, _ in split)
        weights = sum(rows * n_cols * b for b, _, rows in split)
        return weights + groups * 16 + groups * 32 + groups * n_cols * self.scale_bits + k_rows * 32

    def segments(self, k_rows: int) -> list[tuple[int, int, int]]:
        """mixbits K-segments ``[(bits, group_size, k_columns), ...]`` for this
        projection of K inputs, bits descending as EXL2 orders them.

        Rounding: mixbits needs every segment to be whole groups, EXL2 lets
        the last width of a split end in a partial group. Each segment
        boundary is EXL2's cumulative row count (:meth:`row_split`) rounded
        *up* to a multiple of the lcm of the group sizes of this and all
        later widths (clipped to K), which keeps every later segment whole
        too. Rounding up matches EXL2's own direction (a width never gets
        fewer rows than its proportion asks); when EXL2's boundaries are
        already whole groups for what follows, as in all common options,
        the segments equal EXL2's split exactly. Widths left with 0 columns
        are dropped. K must be a multiple of every group size used.
        """
        k_rows = int(k_rows)
        if k_rows <= 0:
            raise ValueError(f"k_rows must be positive, got {k_rows}")
        if list(self.bits) != sorted(self.bits, reverse=True):
            raise ValueError(f"bits {self.bits} are not in descending order; segments must be")
        for b in self.bits:
            if self.group_size[b] not in SEGMENT_GROUP_SIZES:
                raise ValueError(
                    f"group size {self.group_size[b]} for {b}-bit is not one of {SEGMENT_GROUP_SIZES}"
                )
        lcm_all = math.lcm(*(self.group_size[b] for b in self.bits))
        if k_rows % lcm_all:
            raise ValueError(f"K={k_rows} is not a multiple of the group sizes {sorted(set(self.group_size.values()))}")
        split = self.row_split(k_rows)
        segs, start, cum = [], 0, 0
        for i, (b, _, rows) in enumerate(split):
            cum += rows
            unit = math.lcm(*(self.group_size[x] for x in self.bits[i:]))
            end = k_rows if i == len(split) - 1 else min(k_rows, -(-cum // unit) * unit)
            end = max(end, start)
            if end > start:
                segs.append((b, self.group_size[b], end - start))
            start = end
        return segs


@dataclass
class Option:
    """One candidate quantization of a module, as measured."""

    accuracy: float
    total_bits: int
    projections: dict[str, ProjectionQuant]
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d, where: str) -> "Option":
        d = expect_dict(d, where)
        acc = expect_number(require(d, "accuracy", where), at(where, "accuracy"), hi=1.0)
        tb = expect_int(require(d, "total_bits", where), at(where, "total_bits"), lo=1)
        projs, extra = {}, {}
        for k, v in d.items():
            if k in ("accuracy", "total_bits"):
                continue
            if isinstance(v, dict):
                projs[k] = ProjectionQuant.from_dict(v, at(where, k))
            else:
                extra[k] = v
        if not projs:
            raise FormatError(f"{where}: no projections (expected keys like 'q_proj' with objects)")
        return cls(acc, tb, projs, extra)

    def to_dict(self) -> dict:
        out = {"accuracy": self.accuracy, "total_bits": self.total_bits}
        out.update({k: p.to_dict() for k, p in self.projections.items()})
        out.update(self.extra)
        return out

    @property
    def error(self) -> float:
        return 1.0 - self.accuracy

    def cost(self, power: float) -> float:
        """ExLlamaV2's objective term (1 - accuracy) ** power."""
        return max(self.error, 0.0) ** power

    def recompute_total_bits(self, shapes: dict[str, tuple[int, int]]) -> int:
        missing = [p for p in self.projections if p not in shapes]
        if missing:
            raise FormatError(f"no shape known for projection(s) {missing}")
        return sum(q.total_bits(*shapes[p]) for p, q in self.projections.items())

    def segments(self, shapes: dict[str, tuple[int, int]]) -> dict[str, list[tuple[int, int, int]]]:
        """mixbits K-segments of every projection (see ProjectionQuant.segments)."""
        missing = [p for p in self.projections if p not in shapes]
        if missing:
            raise FormatError(f"no shape known for projection(s) {missing}")
        return {p: q.segments(shapes[p][0]) for p, q in self.projections.items()}

    def nparams(self, shapes: dict[str, tuple[int, int]]) -> int:
        missing = [p for p in self.projections if p not in shapes]
        if missing:
            raise FormatError(f"no shape known for projection(s) {missing}")
        return sum(shapes[p][0] * shapes[p][1] for p in self.projections)


@dataclass
class Measurement:
    """A whole ``measurement.json``: module key -> options (None: not measured)."""

    modules: dict[str, list[Option] | None]
    last_module_idx: int | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d, where: str = "measurement.json") -> "Measurement":
        d = expect_dict(d, where)
        mw = "measurement"
        raw = expect_dict(require(d, "measurement", where), mw)
        modules: dict[str, list[Option] | None] = {}
        for key, opts in raw.items():
            kw = at(mw, key)
            if opts is None:
                modules[key] = None
                continue
            opts = expect_list(opts, kw)
            if not opts:
                raise FormatError(f"{kw}: empty option list (use null for unmeasured modules)")
            modules[key] = [Option.from_dict(o, f"{kw}[{i}]") for i, o in enumerate(opts)]
        if not any(v for v in modules.values()):
            raise FormatError(f"{mw}: no module has measured options")
        lmi = d.get("last_module_idx")
        if lmi is not None:
            lmi = expect_int(lmi, at(where, "last_module_idx"), lo=0)
        extra = {k: v for k, v in d.items() if k not in ("measurement", "last_module_idx")}
        return cls(modules, lmi, extra)

    @classmethod
    def load(cls, source) -> "Measurement":
        """Read a path (or an already-parsed dict)."""
        return cls.from_dict(load_json(source, "measurement.json", unique_keys=True))

    def to_dict(self) -> dict:
        out = {"measurement": {k: None if v is None else [o.to_dict() for o in v]
                               for k, v in self.modules.items()}}
        if self.last_module_idx is not None or "last_module_idx" in self.extra:
            out["last_module_idx"] = self.last_module_idx
        out.update(self.extra)
        return out

    def save(self, path) -> None:
        write_json_atomic(self.to_dict(), path)

    def measured(self) -> dict[str, list[Option]]:
        """Modules that have options, in file order."""
        return {k: v for k, v in self.modules.items() if v}

    def check_total_bits(self, shapes: dict[str, tuple[int, int]]) -> int:
        """Recompute every option's total_bits from projection shapes and
        raise on the first mismatch. Returns the number of options checked."""
        n = 0
        for key, opts in self.measured().items():
            for i, o in enumerate(opts):
                where = f"measurement[{key!r}][{i}]['total_bits']"
                try:
                    got = o.recompute_total_bits(shapes)
                except FormatError as e:
                    raise FormatError(f"measurement[{key!r}][{i}]: {e}") from None
                if got != o.total_bits:
                    raise FormatError(
                        f"{where}: stored {o.total_bits} but the shapes give {got} "
                        "(wrong config, or an edited file)"
                    )
                n += 1
        return n

    def module_nparams(self, shapes: dict[str, tuple[int, int]]) -> dict[str, int]:
        """Weights per measured module (from its first option's projections;
        every option of a module must name the same projections)."""
        out = {}
        for key, opts in self.measured().items():
            names = set(opts[0].projections)
            for i, o in enumerate(opts[1:], 1):
                if set(o.projections) != names:
                    raise FormatError(
                        f"measurement[{key!r}][{i}]: projections {sorted(o.projections)} "
                        f"differ from option 0's {sorted(names)}"
                    )
            try:
                out[key] = opts[0].nparams(shapes)
            except FormatError as e:
                raise FormatError(f"measurement[{key!r}]: {e}") from None
        return out


def projection_shapes(config, where: str = "config") -> dict[str, tuple[int, int]]:
    """(K, N) of each projection of a Llama-style decoder from a Hugging Face
    ``config.json`` (a dict or a path): q/k/v/o_proj and gate/up/down_proj.

    Uses hidden_size, num_attention_heads, num_key_value_heads (default: the
    head count), head_dim (default: hidden_size / heads), intermediate_size.
    """
    cfg = expect_dict(load_json(config, "config.json"), where)
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = expect_dict(cfg["text_config"], at(where, "text_config"))
        where = at(where, "text_config")
    h = expect_int(require(cfg, "hidden_size", where), at(where, "hidden_size"), lo=1)
    heads = expect_int(require(cfg, "num_attention_heads", where), at(where, "num_attention_heads"), lo=1)
    kv = cfg.get("num_key_value_heads")
    kv = heads if kv is None else expect_int(kv, at(where, "num_key_value_heads"), lo=1)
    hd = cfg.get("head_dim")
    if hd is None:
        if h % heads:
            raise FormatError(f"{where}: hidden_size {h} is not divisible by num_attention_heads {heads}; give head_dim")
        hd = h // heads
    else:
        hd = expect_int(hd, at(where, "head_dim"), lo=1)
    inter = expect_int(require(cfg, "intermediate_size", where), at(where, "intermediate_size"), lo=1)
    return {
        "q_proj": (h, heads * hd),
        "k_proj": (h, kv * hd),
        "v_proj": (h, kv * hd),
        "o_proj": (heads * hd, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
