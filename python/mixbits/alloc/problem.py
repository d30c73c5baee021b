"""Multiple-choice knapsack instances: one option per slot, each option an
integer bit count and a float cost; built from an ExLlamaV2 measurement or a
per-tensor sensitivity table."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from ..errors import MixbitsError


class InfeasibleBudget(MixbitsError, ValueError):
    """No choice of one option per slot meets the bit budget."""


# Largest total of bits (and of weights) a problem may have: the solver's
# int64 sums then never overflow.
MAX_TOTAL_BITS = 2**62


def _bit_counts(arr: np.ndarray, where: str) -> np.ndarray:
    """``arr`` as int64 after checking each value as a Python number:
    integral (``12.0`` is 12), non-negative, at most 2**62. Checking before
    the cast means a huge or fractional value is an error, never a wrap."""
    vals = []
    for v in arr.reshape(-1).tolist():
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{where}: bit counts must be integers, got {arr.tolist()}")
        if v < 0:
            raise ValueError(f"{where}: bit counts must be >= 0, got {arr.tolist()}")
        if v > MAX_TOTAL_BITS:
            raise ValueError(f"{where}: {v} is more than 2**62")
        vals.append(v)
    return np.array(vals, dtype=np.int64).reshape(arr.shape)


@dataclass
class MCKProblem:
    """``weights[i][j]``: bits of option j in slot i (non-negative ints);
    ``costs[i][j]``: its cost (finite floats). ``names`` label the slots,
    ``nparams`` (optional) count the weights per slot for bits-per-weight."""

    weights: list[np.ndarray]
    costs: list[np.ndarray]
    names: list[str] | None = None
    nparams: np.ndarray | None = None

    def __post_init__(self):
        if len(self.weights) != len(self.costs):
            raise ValueError(f"{len(self.weights)} weight rows but {len(self.costs)} cost rows")
        if not self.weights:
            raise ValueError("a problem needs at least one slot")
        ws, cs = [], []
        for i, (w, c) in enumerate(zip(self.weights, self.costs)):
            w_arr = np.asarray(w)
            c_arr = np.asarray(c, dtype=np.float64)
            if w_arr.ndim != 1 or c_arr.ndim != 1 or len(w_arr) != len(c_arr) or len(w_arr) == 0:
                raise ValueError(f"slot {i}: weights and costs must be equal-length non-empty 1-D lists")
            named = self.names is not None and i < len(self.names)
            w_arr = _bit_counts(w_arr, f"slot {i} ({self.names[i]})" if named else f"slot {i}")
            if not np.all(np.isfinite(c_arr)):
                raise ValueError(f"slot {i}: costs must be finite, got {c_arr.tolist()}")
            ws.append(w_arr)
            cs.append(c_arr)
        self.weights, self.costs = ws, cs
        # The solver sums bits in int64; bounding the largest possible total
        # keeps every partial sum, and every budget it compares, exact.
        if self.max_bits > MAX_TOTAL_BITS:
            raise ValueError(
                f"the largest option of every slot sums to {self.max_bits} bits, more than 2**62: "
                "bit counts this large are not real tensor sizes (corrupt total_bits?)"
            )
        if self.names is not None and len(self.names) != len(ws):
            raise ValueError(f"{len(self.names)} names for {len(ws)} slots")
        if self.nparams is not None:
            counts = _bit_counts(np.asarray(self.nparams), "nparams")
            if counts.shape != (len(ws),) or np.any(counts <= 0):
                raise ValueError("nparams must hold one positive count per slot")
            if sum(int(v) for v in counts) > MAX_TOTAL_BITS:
                raise ValueError("nparams sum to more than 2**62 weights")
            self.nparams = counts

    @property
    def n_slots(self) -> int:
        return len(self.weights)

    @property
    def min_bits(self) -> int:
        return int(sum(int(w.min()) for w in self.weights))

    @property
    def max_bits(self) -> int:
        return int(sum(int(w.max()) for w in self.weights))

    @property
    def total_params(self) -> int | None:
        return None if self.nparams is None else int(self.nparams.sum())

    def evaluate(self, choice) -> tuple[float, int]:
        """(cost, bits) of one option index per slot."""
        choice = [int(j) for j in choice]
        if len(choice) != self.n_slots:
            raise ValueError(f"choice has {len(choice)} entries for {self.n_slots} slots")
        cost = math.fsum(float(self.costs[i][j]) for i, j in enumerate(choice))
        bits = sum(int(self.weights[i][j]) for i, j in enumerate(choice))
        return cost, bits

    def budget_from_bpw(self, bpw: float, *, round_up: bool = False) -> int:
        """floor(bpw * total weights), as ExLlamaV2 turns a bpw target into
        bits (ceil with ``round_up``, for lower bounds). Exact rational
        arithmetic: any finite bpw gives an int, however large (the solver
        caps budgets that cannot bind)."""
        if self.nparams is None:
            raise ValueError("a bits-per-weight budget needs the tensor shapes (nparams)")
        if isinstance(bpw, bool) or not (isinstance(bpw, (int, float)) and math.isfinite(bpw) and bpw > 0):
            raise ValueError(f"bpw must be a positive finite number, got {bpw!r}")
        exact = Fraction(bpw) * self.total_params
        return math.ceil(exact) if round_up else math.floor(exact)

    # ------------------------------------------------------------ builders

    @classmethod
    def from_measurement(cls, measurement, power: float = 2.0, shapes=None) -> "MCKProblem":
        """Slots = measured modules, options = their EXL2 options; cost
        ``(1 - accuracy) ** power``, bits ``total_bits`` (ExLlamaV2's
        objective). With ``shapes`` (projection -> (K, N)), total_bits are
        checked against the shapes and nparams filled in."""
        if not (isinstance(power, (int, float)) and math.isfinite(power) and power > 0):
            raise ValueError(f"power must be a positive number, got {power!r}")
        mods = measurement.measured()
        nparams = None
        if shapes is not None:
            measurement.check_total_bits(shapes)
            npm = measurement.module_nparams(shapes)
            nparams = [npm[k] for k in mods]
        # object arrays: Python ints of any size reach _bit_counts' check (an
        # int64 cast of total_bits 10**30 raised OverflowError first).
        return cls(
            weights=[np.array([o.total_bits for o in opts], dtype=object) for opts in mods.values()],
            costs=[np.array([o.cost(power) for o in opts]) for opts in mods.values()],
            names=list(mods),
            nparams=nparams,
        )

    @classmethod
    def from_table(cls, table, count: str = "storage") -> "MCKProblem":
        """Slots = tensors, options = candidates; cost ``kl``. Bits are
        ``round(nparams * bits)`` for ``count="nominal"`` (so the average is
        allocation.json's average_bits) or each candidate's ``storage_bits``
        for ``count="storage"``."""
        if count not in ("nominal", "storage"):
            raise ValueError(f"count must be 'nominal' or 'storage', got {count!r}")

        def bits_of(e, i, c, j):
            if count == "nominal":
                return int(round(e.nparams * c.bits))
            if c.storage_bits is None:
                raise ValueError(
                    f"entries[{i}]['candidates'][{j}] ({e.path}, {c.kind}): no storage_bits, "
                    "which a storage-bits budget needs"
                )
            return int(c.storage_bits)

        return cls(
            weights=[np.array([bits_of(e, i, c, j) for j, c in enumerate(e.candidates)], dtype=object)
                     for i, e in enumerate(table.entries)],
            costs=[np.array([c.kl for c in e.candidates]) for e in table.entries],
            names=[e.path for e in table.entries],
            nparams=[e.nparams for e in table.entries],
        )
