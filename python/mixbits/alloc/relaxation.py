"""The LP relaxation of the multiple-choice knapsack and its Lagrangian dual.

For a multiplier nu, relaxing the bit constraints gives

    g(nu) = sum_i min_j (cost_ij + nu * bits_ij) - nu * (B if nu >= 0 else L)

which is a lower bound on the optimum for *every* nu (weak duality: any
feasible choice has L <= bits <= B). Its best value equals the LP
relaxation, which the MCKP solves greedily: keep each slot's lower convex
hull of (bits, cost), start every slot at its lightest hull point, and take
hull edges in order of slope (cost change per bit) while the budget allows.
The edge that does not fit is the LP's one fractional slot and minus its
slope is the optimal multiplier (Sinha and Zoltners' greedy for the MCKP).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def lower_hull(w: np.ndarray, c: np.ndarray) -> list[int]:
    """Indices of the lower convex hull of points (w, c), lightest first.
    At equal w only the cheapest point can be on it; collinear middle points
    are dropped, so consecutive slopes strictly increase."""
    order = np.lexsort((c, w))
    hull: list[int] = []
    last_w = None
    for j in order:
        j = int(j)
        if w[j] == last_w:
            continue
        last_w = w[j]
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b when slope(a, b) >= slope(b, j): b is not below the chord a-j
            if (c[b] - c[a]) * float(w[j] - w[b]) >= (c[j] - c[b]) * float(w[b] - w[a]):
                hull.pop()
            else:
                break
        hull.append(j)
    return hull


@dataclass
class Relaxation:
    nu: float              # the optimal multiplier (0 when no bound is binding)
    lp_value: float        # the LP relaxation's optimum
    choice: np.ndarray     # integer choice: hull points taken before the fractional edge
    bits: int              # bits of ``choice``
    fractional: tuple[int, int, int] | None  # (slot, from option, to option) left fractional


def lagrangian_value(Wp: np.ndarray, Cp: np.ndarray, nu: float, budget: int, lower: int | None) -> float:
    """g(nu) for padded option matrices (padding cost = +inf)."""
    rhs = budget if nu >= 0 else (lower or 0)
    return float(np.min(Cp + nu * Wp, axis=1).sum()) - nu * rhs


def solve_lp(weights, costs, budget: int, lower: int | None = None) -> Relaxation:
    """The MCKP LP relaxation by the greedy over convex-hull edges. Assumes
    the instance is feasible (min bits <= budget, max bits >= lower)."""
    n = len(weights)
    choice = np.empty(n, dtype=np.int64)
    edges = []  # (slope, slot, from, to, dw, dc)
    for i, (w, c) in enumerate(zip(weights, costs)):
        h = lower_hull(w, c)
        choice[i] = h[0]
        for a, b in zip(h[:-1], h[1:]):
            dw = int(w[b] - w[a])
            dc = float(c[b] - c[a])
            edges.append((dc / dw, i, a, b, dw, dc))
    edges.sort(key=lambda e: e[0])  # stable: a slot's edges stay in hull order
    W = int(sum(int(w[j]) for w, j in zip(weights, choice)))
    C = float(sum(float(c[j]) for c, j in zip(costs, choice)))
    for slope, i, a, b, dw, dc in edges:
        if slope < 0:
            if W + dw <= budget:
                choice[i], W, C = b, W + dw, C + dc
                continue
            return Relaxation(-slope, C + dc * (budget - W) / dw, choice, W, (i, a, b))
        # Non-improving edges are only worth taking to reach the lower bound.
        if lower is None or W >= lower:
            break
        if W + dw >= lower:
            return Relaxation(-slope, C + dc * (lower - W) / dw, choice, W, (i, a, b))
        choice[i], W, C = b, W + dw, C + dc
    return Relaxation(0.0, C, choice, W, None)
