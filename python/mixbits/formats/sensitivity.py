"""Per-tensor sensitivity tables: the allocator's input for KL-measured models.

A measurement sweep quantizes one tensor at a time at one candidate, runs the
model, and records the KL divergence of the final logits against the
unquantized reference. It writes this table; ``mixbits allocate`` reads it and
writes an ``allocation.json``.

Schema (JSON object)::

    {
      "format": "mixbits.sensitivity",   # required, exactly this string
      "version": 1,                      # required, integer; this reader knows 1
      "metric": "kl",                    # optional: what "kl" holds (default "kl",
                                         #   mean per-token KL(P_ref || Q) in nats)
      "embed_bits": 8,                   # optional: bits of embeddings/head, which
                                         #   are outside the budget; copied to the
                                         #   allocation
      "entries": [                       # required, one per quantizable tensor
        {
          "path": "model.layers.0.mlp.down_proj",  # required, unique module path
          "layer": 0,                    # optional int (default: parsed from path)
          "nparams": 45088768,           # required int > 0: weights in the tensor
          "candidates": [                # required, non-empty
            {"kind": "4", "bits": 4, "kl": 0.0123},
            {"kind": "ternary", "bits": 2, "kl": 0.31, "kl_stderr": 0.02}
          ]
        }
      ]
    }

Candidate fields:

- ``kind`` (required string, unique within the entry): the candidate's name,
  e.g. ``"4b_g64"``, ``"ternary_g64"``, ``"4b10_3b_g64"``. A pure digit
  string must equal ``bits``; ``"ternary"``/``"ternary_*"`` need ``bits`` 2.
- ``bits`` (required number): the nominal width. A JSON integer must be one
  of 2,3,4,5,6,8; a mixed candidate gives its share-weighted width as a JSON
  float in [2, 8] (e.g. 3.1 for 10% 4-bit + 90% 3-bit). Counted as ``nparams * bits`` (rounded to whole
  bits) under a "nominal" budget, allocation.json's average_bits.
- ``kl`` (required finite number): the cost the allocator minimizes, summed
  over tensors.
- ``storage_bits`` (optional int > 0): exact storage of the tensor in this
  candidate, codes plus fp16 scales and biases; required on every candidate
  for a "storage" budget (the default of every command; ``--count nominal``
  for tables without it).
- anything else (``kl_stderr``, ``bpw``, ``group_size``, ...) is kept and
  ignored by the solver.

Unknown top-level keys (``meta``, ...) and entry keys (``shape``,
``seconds``, ...) are kept too, so a table round-trips JSON-equal. A sweep in
progress writes ``"complete": false``; such a table is readable but the
allocator refuses it. Entries whose KL has not been measured yet must be left
out, not written with null.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .allocation import (Allocation, AllocationEntry, check_kind_bits, expect_bits, expect_embed_bits,
                         expect_storage_bits)
from .errors import (
    FormatError,
    at,
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

FORMAT = "mixbits.sensitivity"
VERSION = 1


@dataclass
class Candidate:
    kind: str
    bits: int | float
    kl: float
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d, where: str) -> "Candidate":
        d = expect_dict(d, where)
        kind = expect_str(require(d, "kind", where), at(where, "kind"))
        bits = expect_bits(require(d, "bits", where), at(where, "bits"))
        check_kind_bits(kind, bits, where)
        kl = expect_number(require(d, "kl", where), at(where, "kl"))
        expect_storage_bits(d, where)
        extra = {k: v for k, v in d.items() if k not in ("kind", "bits", "kl")}
        return cls(kind, bits, kl, extra)

    @property
    def storage_bits(self) -> int | None:
        return self.extra.get("storage_bits")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "bits": self.bits, "kl": self.kl, **self.extra}


@dataclass
class SensitivityEntry:
    path: str
    layer: int | None
    nparams: int
    candidates: list[Candidate]
    extra: dict = field(default_factory=dict)
    layer_given: bool = True

    @classmethod
    def from_dict(cls, d, where: str) -> "SensitivityEntry":
        d = expect_dict(d, where)
        path = expect_str(require(d, "path", where), at(where, "path"))
        given = "layer" in d
        layer = expect_int(d["layer"], at(where, "layer"), lo=0) if given else layer_of(path)
        nparams = expect_int(require(d, "nparams", where), at(where, "nparams"), lo=1)
        cw = at(where, "candidates")
        raw = expect_list(require(d, "candidates", where), cw)
        if not raw:
            raise FormatError(f"{cw}: no candidates")
        cands = [Candidate.from_dict(c, f"{cw}[{i}]") for i, c in enumerate(raw)]
        kinds = {}
        for i, c in enumerate(cands):
            if c.kind in kinds:
                raise FormatError(f"{cw}[{i}]['kind']: {c.kind!r} repeats {cw}[{kinds[c.kind]}]")
            kinds[c.kind] = i
        extra = {k: v for k, v in d.items() if k not in ("path", "layer", "nparams", "candidates")}
        return cls(path, layer, nparams, cands, extra, given)

    def to_dict(self) -> dict:
        out = {"path": self.path}
        if self.layer_given:
            out["layer"] = self.layer
        out.update(nparams=self.nparams, candidates=[c.to_dict() for c in self.candidates])
        out.update(self.extra)
        return out


@dataclass
class SensitivityTable:
    entries: list[SensitivityEntry]
    metric: str = "kl"
    embed_bits: int | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d, where: str = "table") -> "SensitivityTable":
        d = expect_dict(d, where)
        fmt = require(d, "format", where)
        if fmt != FORMAT:
            raise FormatError(f"{at(where, 'format')}: expected {FORMAT!r}, got {fmt!r}")
        ver = expect_int(require(d, "version", where), at(where, "version"))
        if ver != VERSION:
            raise FormatError(f"{at(where, 'version')}: this reader knows version {VERSION}, got {ver}")
        metric = expect_str(d.get("metric", "kl"), at(where, "metric"))
        embed = d.get("embed_bits")
        if embed is not None:
            embed = expect_embed_bits(embed, at(where, "embed_bits"))
        ew = "entries"
        raw = expect_list(require(d, "entries", where), ew)
        if not raw:
            raise FormatError(f"{ew}: no entries")
        entries = [SensitivityEntry.from_dict(e, f"{ew}[{i}]") for i, e in enumerate(raw)]
        seen = {}
        for i, e in enumerate(entries):
            if e.path in seen:
                raise FormatError(f"{ew}[{i}]['path']: {e.path!r} repeats {ew}[{seen[e.path]}]")
            seen[e.path] = i
        extra = {k: v for k, v in d.items()
                 if k not in ("format", "version", "metric", "embed_bits", "entries")}
        out = cls(entries, metric, embed, extra)
        out._metric_given = "metric" in d
        return out

    @classmethod
    def load(cls, source) -> "SensitivityTable":
        return cls.from_dict(load_json(source, "sensitivity table", unique_keys=True))

    def to_dict(self) -> dict:
        out = {"format": FORMAT, "version": VERSION}
        if getattr(self, "_metric_given", True):
            out["metric"] = self.metric
        if self.embed_bits is not None:
            out["embed_bits"] = self.embed_bits
        out["entries"] = [e.to_dict() for e in self.entries]
        out.update(self.extra)
        return out

    def save(self, path) -> None:
        write_json_atomic(self.to_dict(), path)

    @property
    def total_params(self) -> int:
        return sum(e.nparams for e in self.entries)

    @property
    def complete(self) -> bool:
        return self.extra.get("complete", True) is not False

    def to_allocation(self, choice, *, low_avg=None, high_avg=None, count: str = "storage") -> Allocation:
        """The allocation.json for one candidate index per entry."""
        if len(choice) != len(self.entries):
            raise ValueError(f"choice has {len(choice)} items for {len(self.entries)} entries")
        out = []
        for e, j in zip(self.entries, choice):
            c = e.candidates[int(j)]
            extra = {"storage_bits": c.storage_bits} if c.storage_bits is not None else {}
            out.append(AllocationEntry(e.path, e.layer, e.nparams, c.bits, c.kind, c.kl, extra))
        alloc = Allocation.from_entries(out, low_avg=low_avg, high_avg=high_avg,
                                        embed_bits=self.embed_bits, count=count)
        alloc.dp_sum_kl = alloc.sum_kl  # the exact optimum, before any joint refinement
        return alloc


def is_sensitivity_table(obj) -> bool:
    return isinstance(obj, dict) and obj.get("format") == FORMAT
