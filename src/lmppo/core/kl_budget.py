"""Choosing WARP's LAMBDA (the share of the merged weight change kept) for a KL budget: a bracketing search on
measured (LAMBDA, KL) points, where KL grows about as LAMBDA squared. Pure arithmetic; `lmppo merge --kl-budget`
measures each point."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass
class BudgetStep:
    """One LAMBDA tried: the merged policy's held-out KL to the start (mean per response) and its training score."""

    toward_start: float
    kl_exact: float
    kl_exact_se: float
    kl_k1: float
    score: float


def next_lambda(steps: Sequence[BudgetStep], budget: float) -> float:
    """The LAMBDA to try next, inside the bracket of the LAMBDAs tried: `lo`, the largest whose KL is under the
    budget (LAMBDA 0, KL 0, when none is), and `hi`, the smallest above it (1 when none is). From `hi` alone,
    KL = c * LAMBDA^2; with both, the power law through them (exponent kept within [0.5, 4]); a point that falls
    outside the bracket's middle 90% is replaced by the bracket's geometric middle."""
    under = [s for s in steps if s.kl_exact < budget]
    over = [s for s in steps if s.kl_exact >= budget]
    lo = max(under, key=lambda s: s.toward_start) if under else None
    hi = min(over, key=lambda s: s.toward_start) if over else None
    if hi is None:
        return 1.0
    if lo is None or lo.kl_exact <= 0 or lo.toward_start >= hi.toward_start:
        return hi.toward_start * (budget / hi.kl_exact) ** 0.5
    power = math.log(hi.kl_exact / lo.kl_exact) / math.log(hi.toward_start / lo.toward_start)
    power = min(max(power, 0.5), 4.0)
    lam = lo.toward_start * (budget / lo.kl_exact) ** (1.0 / power)
    width = hi.toward_start - lo.toward_start
    if not lo.toward_start + 0.05 * width <= lam <= hi.toward_start - 0.05 * width:
        lam = (lo.toward_start * hi.toward_start) ** 0.5
    return lam


def choose_step(steps: Sequence[BudgetStep], budget: float, tolerance: float) -> BudgetStep:
    """The step within `tolerance` (a fraction) of the budget closest to it; else the largest LAMBDA under the
    budget; else the least KL tried."""
    within = [s for s in steps if abs(s.kl_exact - budget) <= tolerance * budget]
    if within:
        return min(within, key=lambda s: abs(s.kl_exact - budget))
    under = [s for s in steps if s.kl_exact <= budget]
    if under:
        return max(under, key=lambda s: s.toward_start)
    return min(steps, key=lambda s: s.kl_exact)


def search_lambda(
    measure: Callable[[float], BudgetStep], budget: float, tolerance: float = 0.1, max_evals: int = 5
) -> tuple[BudgetStep, list[BudgetStep]]:
    """(the chosen step, every step) of the search for the LAMBDA whose KL is the budget; `measure(LAMBDA)` gives a
    step. Stops at a KL within `tolerance` of the budget, or at LAMBDA = 1 when its KL is under the budget."""
    steps = [measure(1.0)]
    while len(steps) < max_evals:
        last = steps[-1]
        if abs(last.kl_exact - budget) <= tolerance * budget or (last.toward_start == 1.0 and last.kl_exact < budget):
            break
        lam = next_lambda(steps, budget)
        if any(abs(s.toward_start - lam) < 1e-4 for s in steps):
            break  # no new point to learn from
        steps.append(measure(lam))
    return choose_step(steps, budget, tolerance), steps
