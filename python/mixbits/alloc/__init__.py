"""Bit allocation: an exact multiple-choice knapsack solver and the
instances it solves (ExLlamaV2 measurements, per-tensor sensitivity tables)."""

from .mckp import Solution, solve
from .problem import InfeasibleBudget, MCKProblem
from .relaxation import lagrangian_value, lower_hull, solve_lp

__all__ = ["InfeasibleBudget", "MCKProblem", "Solution", "lagrangian_value", "lower_hull",
           "solve", "solve_lp"]
