"""The KL-budget search of `lmppo merge --kl-budget`, on hand-worked KL(LAMBDA) curves."""

import pytest

from lmppo.core.kl_budget import BudgetStep, choose_step, next_lambda, search_lambda


def _step(lam: float, kl: float) -> BudgetStep:
    return BudgetStep(toward_start=lam, kl_exact=kl, kl_exact_se=0.0, kl_k1=kl, score=0.0)


def test_search_lambda_hand_worked():
    # KL = 8 lambda^2, budget 2: lambda 1 gives 8, then sqrt(2 / 8) = 0.5 gives exactly 2
    chosen, steps = search_lambda(lambda lam: _step(lam, 8 * lam**2), budget=2.0)
    assert [s.toward_start for s in steps] == [1.0, 0.5] and chosen.toward_start == 0.5
    # KL = 8 lambda^3, budget 1: 1 -> 8; sqrt(1/8) = 0.35355 -> 0.35355; the power law through both has exponent 3,
    # so 0.35355 * (1 / 0.35355)^(1/3) = 0.5 -> 1
    chosen, steps = search_lambda(lambda lam: _step(lam, 8 * lam**3), budget=1.0)
    assert [round(s.toward_start, 5) for s in steps] == [1.0, 0.35355, 0.5]
    assert chosen.toward_start == pytest.approx(0.5) and chosen.kl_exact == pytest.approx(1.0)
    # a whole merge under the budget is kept whole, after one measurement
    chosen, steps = search_lambda(lambda lam: _step(lam, 3 * lam**2), budget=5.0)
    assert len(steps) == 1 and chosen.toward_start == 1.0
    # the exponent is kept within [0.5, 4]: a bracket that implies 10 steps as if it were 4
    assert next_lambda([_step(1.0, 10.0), _step(0.5, 10.0 * 0.5**10)], 0.02) == pytest.approx(
        0.5 * (0.02 / (10.0 * 0.5**10)) ** (1 / 4)
    )
    # the bracket is (0.25, 0.5); the power law through it (exponent log 4.99 / log 2 = 2.32) asks for
    # 0.25 * 4.9^(1 / 2.32) = 0.496, outside the bracket's middle 90% (0.2625-0.4875): its geometric middle instead
    assert next_lambda([_step(1.0, 5.0), _step(0.5, 4.99), _step(0.25, 1.0)], 4.9) == pytest.approx((0.25 * 0.5) ** 0.5)
    assert next_lambda([_step(1.0, 3.0)], 5.0) == 1.0  # never above 1
    # max_evals bounds the search; then the largest LAMBDA under the budget, else the least KL
    chosen, steps = search_lambda(lambda lam: _step(lam, 100 * lam**0.2), budget=1.0, max_evals=3)
    assert len(steps) == 3 and chosen.kl_exact == min(s.kl_exact for s in steps)
    assert choose_step([_step(1.0, 9.0), _step(0.6, 4.0), _step(0.4, 1.5)], 5.0, 0.1).toward_start == 0.6
    assert choose_step([_step(1.0, 9.0), _step(0.7, 5.3), _step(0.69, 4.9)], 5.0, 0.1).toward_start == 0.69
