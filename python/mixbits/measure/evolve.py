"""Evolutionary search over allocations against the measured joint KL.

Summed per-tensor KL is the knapsack's objective; the joint KL of all
tensors quantized together is what matters, and the two disagree where
damage interacts. Following EvoPress, the search keeps one parent (the
best allocation measured so far, starting from the knapsack optimum) and
each generation:

1. makes ``offspring`` children by 1..``max_moves`` random level switches
   (one tensor up to its next wider candidate, another down to its next
   narrower one) that keep the budget window;
2. scores every child on a small prefix of the calibration chunks, keeps
   the best few, scores those on a larger prefix, and so on: cheap noisy
   selection first, exact comparison last;
3. replaces the parent only when a survivor beats it on the full
   calibration set.

Cost is counted in full-set-equivalent evaluations (a child scored on a
quarter of the chunks costs 0.25), so ``budget`` bounds the work whatever
the stages are. Runs are deterministic for a seed.
"""

from __future__ import annotations

import numpy as np


def _level_moves(weights, choice):
    """Per slot: the next wider option (more bits) and next narrower one."""
    up, down = {}, {}
    for i, w in enumerate(weights):
        j = choice[i]
        wider = [k for k in range(len(w)) if w[k] > w[j]]
        if wider:
            up[i] = min(wider, key=lambda k: w[k])
        narrower = [k for k in range(len(w)) if w[k] < w[j]]
        if narrower:
            down[i] = max(narrower, key=lambda k: w[k])
    return up, down


def mutate(weights, choice, budget, lower, rng, max_moves: int = 3):
    """A child of ``choice`` within [lower, budget] bits, or None."""
    child = list(choice)
    bits = sum(weights[i][j] for i, j in enumerate(child))
    for _ in range(int(rng.integers(1, max_moves + 1))):
        up, down = _level_moves(weights, child)
        if not up or not down:
            break
        a = int(rng.choice(list(up)))
        b = int(rng.choice([i for i in down if i != a] or [-1]))
        if b < 0:
            break
        nb = bits + weights[a][up[a]] - weights[a][child[a]] + weights[b][down[b]] - weights[b][child[b]]
        if nb > budget or (lower is not None and nb < lower):
            continue
        child[a], child[b], bits = up[a], down[b], nb
    return None if child == list(choice) else child


def evolve(score, weights, start, start_score, budget, lower=None, *, n_chunks: int,
           eval_budget: float = 30.0, offspring: int = 8, survivors=(2, 1), seed: int = 0,
           max_moves: int = 3, on_generation=None):
    """Search from ``start`` (its full-set score ``start_score``).

    ``score(choice, chunks)``: mean joint KL on the first ``chunks``
    calibration chunks. ``survivors``: how many children pass each stage;
    stage s scores on ``n_chunks * 4**(s - len(survivors))`` chunks (at
    least one), the last stage on all of them.
    Returns (best choice, its score, cost used, generations, improvements).
    """
    rng = np.random.default_rng(seed)
    stages = [max(1, n_chunks // 4 ** (len(survivors) - s)) for s in range(len(survivors))]
    stages.append(n_chunks)
    parent, best = list(start), float(start_score)
    cost, gens, wins = 0.0, 0, 0
    seen = {tuple(parent)}
    while True:
        children = []
        for _ in range(offspring * 4):  # a few tries: some mutations leave the window
            if len(children) == offspring:
                break
            c = mutate(weights, parent, budget, lower, rng, max_moves)
            if c is not None and tuple(c) not in seen:
                seen.add(tuple(c))
                children.append(c)
        keep = [offspring, *survivors]
        need = sum(min(len(children), k) * n / n_chunks for k, n in zip(keep, stages))
        if not children or cost + need > eval_budget:
            break
        pool = children
        for k_next, chunks in zip([*survivors, 1], stages):
            scored = sorted(((score(c, chunks), i) for i, c in enumerate(pool)))
            cost += len(pool) * chunks / n_chunks
            pool = [pool[i] for _, i in scored[:k_next]]
            last = scored[0][0]
        gens += 1
        if last < best:
            parent, best = pool[0], last
            wins += 1
        if on_generation is not None:
            on_generation(gens, best, cost)
    return parent, best, cost, gens, wins
