"""Exact multiple-choice knapsack: one option per slot, minimize the summed
cost subject to ``lower <= summed bits <= budget``.

Method: dynamic programming over Pareto frontiers of partial solutions
(bits, cost), slot by slot, with two exact reductions that keep the
frontier small at any budget size (bits are counts like 1e10, so a table
indexed by bits is out of the question):

- dominance: a partial solution is dropped when another one has no more
  cost and every completion that is feasible for it is feasible for the
  other too (lighter is enough while the lower bound cannot bind, heavier
  while the budget cannot bind);
- bounding: a partial solution is dropped when its Lagrangian lower bound
  (cost so far + nu * bits so far + the relaxed remainder - nu * budget, nu
  the LP optimal multiplier) exceeds a threshold T. Passes run with T
  growing from just above the LP bound up to the cost of a known solution
  (the LP rounded, then improved by single-slot moves); a pass that finds a
  solution costing <= T has found the optimum. The same bound removes, per
  pass, every option whose reduced cost alone exceeds T - bound, and slots
  left with one option are folded into constants. On real instances the
  LP gap is tiny, so few slots stay free and the frontier stays at
  hundreds to tens of thousands of states.

Both reductions only remove states that cannot beat a kept one, so the
result is optimal. Cost comparisons allow a relative 1e-10 slack for float
rounding (states within it of the threshold are kept, never dropped).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from .problem import InfeasibleBudget, MCKProblem
from .relaxation import lagrangian_value, solve_lp


@dataclass
class Solution:
    choice: np.ndarray          # option index per slot
    cost: float
    bits: int
    budget: int
    lower: int | None
    lower_bound: float          # Lagrangian (= LP) lower bound on the optimum
    nu: float                   # the multiplier that gives it
    total_params: int | None = None
    stats: dict = field(default_factory=dict)

    @property
    def gap(self) -> float:
        """cost - lower_bound: how far the LP bound is from this optimum."""
        return self.cost - self.lower_bound

    @property
    def bpw(self) -> float | None:
        return None if not self.total_params else self.bits / self.total_params


def _padded(problem: MCKProblem):
    m = max(len(w) for w in problem.weights)
    Wp = np.zeros((problem.n_slots, m), dtype=np.int64)
    Cp = np.full((problem.n_slots, m), np.inf)
    for i, (w, c) in enumerate(zip(problem.weights, problem.costs)):
        Wp[i, : len(w)] = w
        Cp[i, : len(c)] = c
    return Wp, Cp


def _check_budget(problem: MCKProblem, budget, lower):
    for name, v in (("budget", budget), ("lower", lower)):
        if v is None and name == "lower":
            continue
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name} must be an integer number of bits, got {v!r}")
        if v < 0:
            raise ValueError(f"{name} must be >= 0 bits, got {v}")
    # A budget above the most bits any choice uses cannot bind: solve with
    # that instead, so every comparison stays inside int64.
    budget = min(int(budget), problem.max_bits)
    lower = None if lower is None else int(lower)
    per = ""
    if problem.total_params:
        per = f" ({problem.min_bits / problem.total_params:.4f} bpw)"
    if problem.min_bits > budget:
        raise InfeasibleBudget(
            f"budget of {budget} bits is below the cheapest choice: every slot at its "
            f"smallest option needs {problem.min_bits} bits{per}"
        )
    if lower is not None:
        if problem.max_bits < lower:
            raise InfeasibleBudget(
                f"lower bound of {lower} bits is above the largest choice ({problem.max_bits} bits)"
            )
        if lower > budget:
            raise ValueError(f"lower bound {lower} bits exceeds the budget {budget} bits")
    return budget, lower


def _improve(problem: MCKProblem, choice: np.ndarray, budget: int, lower: int | None, passes: int = 3):
    """Local search for a good incumbent: move single slots to their best
    option that keeps the solution feasible (first reaching ``lower`` if the
    start is below it)."""
    choice = choice.copy()
    W = sum(int(problem.weights[i][j]) for i, j in enumerate(choice))
    lo = lower if lower is not None else -1
    if W < lo:  # repair: cheapest cost per added bit until the lower bound holds
        while W < lo:
            best = None
            for i, (w, c) in enumerate(zip(problem.weights, problem.costs)):
                dw = w - w[choice[i]]
                ok = (dw > 0) & (W + dw <= budget)
                if ok.any():
                    r = np.where(ok, (c - c[choice[i]]) / np.where(dw > 0, dw, 1), np.inf)
                    j = int(np.argmin(r))
                    if best is None or r[j] < best[0]:
                        best = (r[j], i, j)
            if best is None:
                return None
            _, i, j = best
            W += int(problem.weights[i][j] - problem.weights[i][choice[i]])
            choice[i] = j
    for _ in range(passes):
        changed = False
        for i, (w, c) in enumerate(zip(problem.weights, problem.costs)):
            cur = choice[i]
            nw = W - w[cur] + w
            ok = (nw <= budget) & (nw >= lo)
            cand = np.where(ok, c, np.inf)
            j = int(np.argmin(cand))
            if cand[j] < c[cur]:
                W = int(nw[j])
                choice[i] = j
                changed = True
        if not changed:
            break
    return choice


def _reduce_options(problem: MCKProblem, lower):
    """Padded (bits, cost, original index) matrices of each slot's options,
    without the options another option beats on both bits and cost (only
    valid without a lower bound, where more bits never help). Padding has
    cost +inf."""
    rows = []
    for w, c in zip(problem.weights, problem.costs):
        order = np.lexsort((c, w))
        if lower is None:
            keep, best = [], np.inf
            for j in order:
                if c[j] < best:
                    keep.append(j)
                    best = c[j]
            order = np.array(keep, dtype=np.int64)
        rows.append(order)
    m = max(len(r) for r in rows)
    n = len(rows)
    Wr = np.zeros((n, m), dtype=np.int64)
    Cr = np.full((n, m), np.inf)
    Ir = np.full((n, m), -1, dtype=np.int64)
    for i, (r, w, c) in enumerate(zip(rows, problem.weights, problem.costs)):
        Wr[i, : len(r)] = w[r]
        Cr[i, : len(r)] = c[r]
        Ir[i, : len(r)] = r
    return Wr, Cr, Ir


def _frontier_filter(NW, NC, thr_low, thr_high):
    """Sort states by bits and drop dominated ones (see the module docstring).
    Returns the kept positions into the inputs.

    The inputs are a few runs already sorted by bits (one per option), so a
    stable sort merges them in near-linear time."""
    order = np.argsort(NW, kind="stable")
    NW, NC = NW[order], NC[order]
    if len(NW) > 1:
        # at equal bits only the cheapest state can matter: keep the first
        # cheapest of each run of equal bits
        first = np.empty(len(NW), dtype=bool)
        first[0] = True
        np.not_equal(NW[1:], NW[:-1], out=first[1:])
        if not first.all():
            starts = np.flatnonzero(first)
            grp = np.cumsum(first) - 1
            is_min = NC == np.minimum.reduceat(NC, starts)[grp]
            cand = np.flatnonzero(is_min)
            head = np.empty(len(cand), dtype=bool)
            head[0] = True
            np.not_equal(grp[cand[1:]], grp[cand[:-1]], out=head[1:])
            cand = cand[head]
            order, NW, NC = order[cand], NW[cand], NC[cand]
    # lighter dominates heavier among states the lower bound cannot bind
    z0 = int(np.searchsorted(NW, thr_low, side="left"))
    if len(NW) - z0 > 1:
        zc = NC[z0:]
        keep = np.ones(len(NW), dtype=bool)
        keep[z0 + 1:] = zc[1:] < np.minimum.accumulate(zc)[:-1]
        order, NW, NC = order[keep], NW[keep], NC[keep]
    # heavier dominates lighter among states the budget cannot bind
    z1 = int(np.searchsorted(NW, thr_high, side="right"))
    if z1 > 1:
        zc = NC[:z1][::-1]
        keep_r = np.ones(z1, dtype=bool)
        keep_r[1:] = zc[1:] < np.minimum.accumulate(zc)[:-1]
        keep = np.ones(len(NW), dtype=bool)
        keep[:z1] = keep_r[::-1]
        order = order[keep]
    return order


def _dp(ws, cs, idx, nu, rels, rhs, budget, lower, threshold):
    """One pass of the frontier DP keeping states whose Lagrangian bound is
    <= ``threshold``. Returns (choice, cost, peak states) of the cheapest
    complete solution kept, or (None, inf, peak) if none survives."""
    n = len(ws)
    if n == 0:
        ok = budget >= 0 and (lower is None or lower <= 0)
        return (np.empty(0, dtype=np.int64), 0.0, 1) if ok else (None, math.inf, 1)
    mins = np.array([w.min() for w in ws], dtype=np.int64)
    maxs = np.array([w.max() for w in ws], dtype=np.int64)
    rmin = np.concatenate([np.cumsum(mins[::-1])[::-1][1:], [0]])
    rmax = np.concatenate([np.cumsum(maxs[::-1])[::-1][1:], [0]])
    # Lagrangian bound of a state after slot k:
    # C + nu*W + sum_{i>k} min_j(c + nu*w) - nu*rhs  (a bound on every completion)
    const = np.concatenate([np.cumsum(rels[::-1])[::-1][1:], [0.0]]) - nu * rhs
    W = np.zeros(1, dtype=np.int64)
    C = np.zeros(1)
    back = []
    peak = 1
    for k in range(n):
        w, c = ws[k], cs[k]
        ns = len(W)
        # option-major, so each option's block stays sorted by bits
        NW = (w[:, None] + W[None, :]).ravel()
        NC = (c[:, None] + C[None, :]).ravel()
        ok = NW + rmin[k] <= budget
        if lower is not None:
            ok &= NW + rmax[k] >= lower
        if math.isfinite(threshold):
            ok &= NC + nu * NW + const[k] <= threshold
        pos = np.flatnonzero(ok)
        NW, NC = NW[pos], NC[pos]
        thr_low = -np.inf if lower is None else lower - rmin[k]
        keep = _frontier_filter(NW, NC, thr_low, budget - rmax[k])
        pos = pos[keep]
        W, C = NW[keep], NC[keep]
        back.append((pos % ns, pos // ns))
        peak = max(peak, len(W))
        if len(W) == 0:
            return None, math.inf, peak
    s = int(np.argmin(C))
    best = float(C[s])
    choice = np.empty(n, dtype=np.int64)
    for k in range(n - 1, -1, -1):
        par, opt = back[k]
        choice[k] = idx[k][opt[s]]
        s = int(par[s])
    return choice, best, peak


def _pass(Wr, Cr, Ir, nu, lb, budget, lower, threshold):
    """Prepare and run one DP pass at ``threshold``: drop every option whose
    reduced cost alone exceeds the allowance (it cannot be in a solution
    cheaper than the threshold), fold slots left with one option into
    constants, and run the DP over the rest."""
    red = Cr + nu * Wr
    red = red - red.min(axis=1, keepdims=True)
    keepm = red <= (threshold - lb)
    keepm |= red <= 0  # the slot's best option always stays (guards float ties)
    count = keepm.sum(axis=1)
    fixed = count == 1
    fj = np.argmax(keepm, axis=1)
    rows = np.flatnonzero(fixed)
    Wf = int(Wr[rows, fj[rows]].sum())
    Cf = float(Cr[rows, fj[rows]].sum())
    free = np.flatnonzero(~fixed)
    ws, cs, ix = [], [], []
    for i in free:
        sel = keepm[i]
        ws.append(Wr[i, sel]); cs.append(Cr[i, sel]); ix.append(Ir[i, sel])
    rels = (Cr[free] + nu * Wr[free]).min(axis=1)
    rhs = (budget if nu >= 0 else (lower or 0)) - Wf
    ch, cost, peak = _dp(ws, cs, ix, nu, rels, rhs, budget - Wf,
                         None if lower is None else lower - Wf, threshold - Cf)
    if ch is None:
        return None, math.inf, peak, len(free)
    choice = np.empty(len(Wr), dtype=np.int64)
    choice[rows] = Ir[rows, fj[rows]]
    choice[free] = ch
    return choice, cost + Cf, peak, len(free)


def solve(problem: MCKProblem, budget: int, lower: int | None = None) -> Solution:
    """The exact optimum of ``problem`` with ``lower <= bits <= budget``.

    Raises InfeasibleBudget (a ValueError) when even the smallest option of
    every slot exceeds ``budget`` (or the largest stay below ``lower``).

    The DP runs with a threshold T on the Lagrangian bound, starting just
    above the bound and growing geometrically: a pass that finds a solution
    of cost <= T has found the optimum (every solution cheaper than T keeps
    all its partial states), and the last pass uses T = the incumbent's
    cost, which is exact by itself. Tight thresholds keep passes small.
    """
    t0 = time.perf_counter()
    budget, lower = _check_budget(problem, budget, lower)
    Wp, Cp = _padded(problem)

    relax = solve_lp(problem.weights, problem.costs, budget, lower)
    nu = relax.nu
    rhs = budget if nu >= 0 else (lower or 0)
    lb = lagrangian_value(Wp, Cp, nu, budget, lower)

    inc_choice = _improve(problem, relax.choice, budget, lower)
    inc = math.inf
    if inc_choice is not None:
        inc, inc_bits = problem.evaluate(inc_choice)
        if not (inc_bits <= budget and (lower is None or inc_bits >= lower)):
            inc, inc_choice = math.inf, None

    Wr, Cr, Ir = _reduce_options(problem, lower)
    slack = 1e-10 * (abs(lb) + abs(nu) * rhs + 1.0)

    passes, peak, free = 0, 0, 0
    choice, best = None, math.inf
    delta = (inc - lb) / 4096 if math.isfinite(inc) else math.inf
    while True:
        final = not (delta < inc - lb)
        threshold = (inc + slack) if final else (lb + delta + slack)
        passes += 1
        ch, cost, pk, free = _pass(Wr, Cr, Ir, nu, lb, budget, lower, threshold)
        peak = max(peak, pk)
        if ch is not None and (cost <= threshold or final):
            choice, best = ch, cost
            break
        if ch is not None and cost < inc:
            inc, inc_choice = cost, ch  # a better incumbent: the next pass can be the final one
        if final:
            break
        delta *= 4

    if choice is None or (inc_choice is not None and inc < best):
        # Every state was bounded away by the incumbent: it is optimal.
        choice = inc_choice
    cost, bits = problem.evaluate(choice)
    return Solution(
        choice=choice, cost=cost, bits=bits, budget=budget, lower=lower,
        lower_bound=lb, nu=nu, total_params=problem.total_params,
        stats={"peak_states": peak, "passes": passes, "free_slots": free,
               "lp_value": relax.lp_value, "seconds": time.perf_counter() - t0},
    )
