"""``allocation.json``: one chosen candidate per tensor, with its summary.

Layout (all keys but ``assignment`` and ``average_bits`` optional)::

    {"average_bits": 3.4985,          # sum(nparams*bits) / sum(nparams)
     "embed_bits": 8,                 # embedding/head bits (outside the budget if not assigned)
     "budget": {"low_avg": 3.4, "high_avg": 3.5},
     "sum_kl": 2.978,                 # sum of the assignment's kl
     "dp_sum_kl": 2.540,              # the allocator's optimum before refinement
     "joint_refine": {...},           # calibration ids, joint KL before/after, swaps
     "assignment": [{"path": "...mlp.down_proj", "layer": 19, "nparams": 12582912,
                     "bits": 2, "kind": "ternary", "kl": 0.0068}, ...]}

``kind`` names the candidate (``"2"``..``"8"``, ``"ternary"``, or a
sweep's candidate name such as ``"4b_g64"``); ``bits`` is its nominal width:
an integer width in 2,3,4,5,6,8 (ternary counts as 2), or for a mixed
candidate the share-weighted width (a JSON float in [2, 8]). Entries may
carry ``storage_bits`` (exact storage including scales and biases); the
budget may carry ``"count": "nominal"|"storage"`` saying which bits
``low_avg``/``high_avg`` bound (default nominal), and ``low_avg`` may be
null (no lower bound).

Reading recomputes ``average_bits`` and ``sum_kl`` and rejects a file whose
stored values disagree, or whose average lies outside its own budget.
Unknown keys are kept, so ``save(load(f))`` is JSON-equal to ``f``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import (
    FormatError,
    at,
    check_close,
    expect_dict,
    expect_int,
    expect_list,
    expect_number,
    expect_str,
    load_json,
    require,
    write_json_atomic,
)
from .exl2 import layer_of

ALLOWED_BITS = (2, 3, 4, 5, 6, 8)
EMBED_BITS = ALLOWED_BITS + (16,)  # embeddings/head: a quantized width, or 16 (left in half precision)
KL_FLOOR = -1e-6  # a KL is never negative; float rounding of a mean may dip just below 0
TERNARY = "ternary"


def expect_embed_bits(obj, where: str) -> int:
    b = expect_int(obj, where, lo=1)
    if b not in EMBED_BITS:
        raise FormatError(f"{where}: {b} is not a width embeddings are stored in; expected one of {EMBED_BITS}")
    return b


def check_kind_bits(kind: str, bits, where: str) -> None:
    """A numeric kind must equal its bits; ternary is stored as 2 bits."""
    if kind == TERNARY or kind.startswith(TERNARY + "_"):
        if bits != 2:
            raise FormatError(f"{where}: kind {kind!r} is stored as 2 bits, got bits={bits}")
    elif kind.isdigit() and int(kind) != bits:
        raise FormatError(f"{where}: kind {kind!r} disagrees with bits={bits}")


def expect_bits(obj, where: str):
    """A nominal width: a JSON integer must be one of ALLOWED_BITS; a JSON
    float is a mixed candidate's share-weighted width and must lie in
    [2, 8] (so 7.0, half 8-bit and half 6-bit, is fine while 7 is not)."""
    b = expect_number(obj, where)
    if isinstance(b, int):
        if b not in ALLOWED_BITS:
            raise FormatError(f"{where}: unknown bit width {obj!r}; expected one of {ALLOWED_BITS}")
        return b
    if not (min(ALLOWED_BITS) <= b <= max(ALLOWED_BITS)):
        raise FormatError(f"{where}: fractional width {obj!r} outside [{min(ALLOWED_BITS)}, {max(ALLOWED_BITS)}]")
    return b


def expect_storage_bits(d: dict, where: str):
    """Optional exact storage bits (null allowed)."""
    v = d.get("storage_bits")
    if v is not None:
        expect_int(v, at(where, "storage_bits"), lo=1)
    return v


@dataclass
class AllocationEntry:
    path: str
    layer: int | None
    nparams: int
    bits: int | float
    kind: str
    kl: float
    extra: dict = field(default_factory=dict)

    _KEYS = ("path", "layer", "nparams", "bits", "kind", "kl")

    @classmethod
    def from_dict(cls, d, where: str) -> "AllocationEntry":
        d = expect_dict(d, where)
        path = expect_str(require(d, "path", where), at(where, "path"))
        layer = d.get("layer")
        if layer is not None:
            layer = expect_int(layer, at(where, "layer"), lo=0)
        nparams = expect_int(require(d, "nparams", where), at(where, "nparams"), lo=1)
        bits = expect_bits(require(d, "bits", where), at(where, "bits"))
        kind = expect_str(require(d, "kind", where), at(where, "kind"))
        check_kind_bits(kind, bits, where)
        kl = expect_number(require(d, "kl", where), at(where, "kl"), lo=KL_FLOOR)
        expect_storage_bits(d, where)
        extra = {k: v for k, v in d.items() if k not in cls._KEYS}
        return cls(path, layer, nparams, bits, kind, kl, extra)

    def to_dict(self) -> dict:
        out = {"path": self.path}
        if self.layer is not None:
            out["layer"] = self.layer
        out.update(nparams=self.nparams, bits=self.bits, kind=self.kind, kl=self.kl)
        out.update(self.extra)
        return out


def average_bits(entries) -> float:
    n = sum(e.nparams for e in entries)
    return sum(e.nparams * e.bits for e in entries) / n


def average_storage_bits(entries) -> float | None:
    """Storage bits per weight, if every entry has storage_bits."""
    if any(e.extra.get("storage_bits") is None for e in entries):
        return None
    return sum(e.extra["storage_bits"] for e in entries) / sum(e.nparams for e in entries)


@dataclass
class Allocation:
    assignment: list[AllocationEntry]
    average_bits: float
    sum_kl: float | None = None
    embed_bits: int | None = None
    budget: dict | None = None  # {"low_avg": .., "high_avg": ..}
    dp_sum_kl: float | None = None
    joint_refine: dict | None = None
    extra: dict = field(default_factory=dict)
    null_keys: tuple = ()  # optional keys the file gave as null (written back as null)

    _KEYS = ("average_bits", "embed_bits", "budget", "sum_kl", "dp_sum_kl", "joint_refine", "assignment")

    @classmethod
    def from_entries(cls, entries, *, low_avg=None, high_avg=None, embed_bits=None,
                     dp_sum_kl=None, count: str = "nominal") -> "Allocation":
        """A fresh allocation with its summaries computed from ``entries``."""
        entries = list(entries)
        if not entries:
            raise ValueError("an allocation needs at least one entry")
        budget = None
        if high_avg is not None:
            budget = {"low_avg": low_avg, "high_avg": high_avg}
            if count != "nominal":
                budget["count"] = count
        return cls(entries, average_bits(entries), sum(e.kl for e in entries), embed_bits,
                   budget, dp_sum_kl)

    @classmethod
    def from_dict(cls, d, where: str = "allocation.json", check: bool = True) -> "Allocation":
        d = expect_dict(d, where)
        aw = "assignment"
        raw = expect_list(require(d, "assignment", where), aw)
        if not raw:
            raise FormatError(f"{aw}: empty assignment")
        entries = [AllocationEntry.from_dict(e, f"{aw}[{i}]") for i, e in enumerate(raw)]
        seen = {}
        for i, e in enumerate(entries):
            if e.path in seen:
                raise FormatError(f"{aw}[{i}]['path']: {e.path!r} already assigned at {aw}[{seen[e.path]}]")
            seen[e.path] = i
            if e.layer is not None and layer_of(e.path) not in (None, e.layer):
                raise FormatError(f"{aw}[{i}]['layer']: {e.layer} but the path says layer {layer_of(e.path)}")
        avg = expect_number(require(d, "average_bits", where), at(where, "average_bits"), lo=0)
        sum_kl = d.get("sum_kl")
        if sum_kl is not None:
            sum_kl = expect_number(sum_kl, at(where, "sum_kl"))
        embed = d.get("embed_bits")
        if embed is not None:
            embed = expect_embed_bits(embed, at(where, "embed_bits"))
        budget = d.get("budget")
        if budget is not None:
            bw = at(where, "budget")
            budget = expect_dict(budget, bw)
            lo = budget.get("low_avg")
            if lo is not None:
                lo = expect_number(lo, at(bw, "low_avg"), lo=0)
            hi = expect_number(require(budget, "high_avg", bw), at(bw, "high_avg"), lo=0)
            if lo is not None and lo > hi:
                raise FormatError(f"{bw}: low_avg {lo} > high_avg {hi}")
            count = budget.get("count", "nominal")
            if count not in ("nominal", "storage"):
                raise FormatError(f"{at(bw, 'count')}: expected 'nominal' or 'storage', got {count!r}")
        dp = d.get("dp_sum_kl")
        if dp is not None:
            dp = expect_number(dp, at(where, "dp_sum_kl"))
        jr = d.get("joint_refine")
        if jr is not None:
            jw = at(where, "joint_refine")
            jr = expect_dict(jr, jw)
            for k in ("joint_kl_before", "joint_kl_after"):
                if k in jr:
                    expect_number(jr[k], at(jw, k))
            for k in ("calibration_n", "swaps"):
                if k in jr:
                    expect_int(jr[k], at(jw, k), lo=0)
            if "calibration_ids" in jr:
                ids = expect_list(jr["calibration_ids"], at(jw, "calibration_ids"))
                if "calibration_n" in jr and len(ids) != jr["calibration_n"]:
                    raise FormatError(f"{jw}: calibration_n {jr['calibration_n']} but {len(ids)} calibration_ids")
        extra = {k: v for k, v in d.items() if k not in cls._KEYS}
        nulls = tuple(k for k in ("embed_bits", "budget", "sum_kl", "dp_sum_kl", "joint_refine")
                      if k in d and d[k] is None)
        out = cls(entries, avg, sum_kl, embed, budget, dp, jr, extra, nulls)
        if check:
            out.check(where)
        return out

    def check(self, where: str = "allocation.json") -> None:
        """Stored summaries must match the assignment."""
        check_close(self.average_bits, average_bits(self.assignment), at(where, "average_bits"), "average_bits")
        if self.sum_kl is not None:
            check_close(self.sum_kl, math.fsum(e.kl for e in self.assignment), at(where, "sum_kl"), "sum_kl")
        if self.budget is not None:
            lo, hi = self.budget.get("low_avg"), self.budget["high_avg"]
            lo = 0.0 if lo is None else lo
            if self.budget.get("count", "nominal") == "nominal":
                avg, what = self.average_bits, "average_bits"
            else:
                avg, what = average_storage_bits(self.assignment), "storage bits per weight"
            if avg is not None and not (lo - 1e-9 <= avg <= hi + 1e-9):
                raise FormatError(f"{at(where, 'budget')}: {what} {avg} outside the budget [{lo}, {hi}]")

    @classmethod
    def load(cls, source, check: bool = True) -> "Allocation":
        return cls.from_dict(load_json(source, "allocation.json", unique_keys=True), check=check)

    def to_dict(self) -> dict:
        out = {"average_bits": self.average_bits}
        if self.embed_bits is not None or "embed_bits" in self.null_keys:
            out["embed_bits"] = self.embed_bits
        if self.budget is not None or "budget" in self.null_keys:
            out["budget"] = self.budget
        if self.sum_kl is not None or "sum_kl" in self.null_keys:
            out["sum_kl"] = self.sum_kl
        if self.dp_sum_kl is not None or "dp_sum_kl" in self.null_keys:
            out["dp_sum_kl"] = self.dp_sum_kl
        if self.joint_refine is not None or "joint_refine" in self.null_keys:
            out["joint_refine"] = self.joint_refine
        out["assignment"] = [e.to_dict() for e in self.assignment]
        out.update(self.extra)
        return out

    def save(self, path) -> None:
        write_json_atomic(self.to_dict(), path)

    @property
    def total_params(self) -> int:
        return sum(e.nparams for e in self.assignment)
