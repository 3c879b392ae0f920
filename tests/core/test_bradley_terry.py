"""lmppo.core.bradley_terry: the reward-model loss and its pair statistics, worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from lmppo.core.bradley_terry import bradley_terry_loss, pair_accuracy_and_margin, pearson_correlation


def test_loss_by_hand():
    # differences 2, 0, -1: -log sigmoid(d) = log(1 + e^-d) = 0.126928, 0.693147, 1.313262; mean 0.711113
    chosen, rejected = torch.tensor([2.0, 0.5, 0.0]), torch.tensor([0.0, 0.5, 1.0])
    expected = (math.log(1 + math.exp(-2)) + math.log(2) + math.log(1 + math.exp(1))) / 3
    assert abs(float(bradley_terry_loss(chosen, rejected)) - expected) < 1e-6
    assert abs(expected - 0.711113) < 1e-6


def test_margin_and_centring_by_hand():
    """TRL's RewardTrainer: -log sigmoid(r_c - r_r - margin), plus coef x mean((r_c + r_r)^2)."""
    chosen, rejected, margin = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([1.0, 0.0])
    # differences less margins 1, 0: log(1 + e^-1) = 0.313262, log 2 = 0.693147; mean 0.503204
    assert float(bradley_terry_loss(chosen, rejected, margin)) == pytest.approx(0.503204, abs=1e-6)
    # sums 2, 0: mean of squares 2; x 0.5 = 1
    assert float(bradley_terry_loss(chosen, rejected, margin, 0.5)) == pytest.approx(1.503204, abs=1e-6)
    assert float(bradley_terry_loss(chosen, rejected, torch.zeros(2))) == float(bradley_terry_loss(chosen, rejected))


def test_the_gradient_raises_chosen_and_lowers_rejected():
    chosen, rejected = torch.tensor([0.0], requires_grad=True), torch.tensor([0.0], requires_grad=True)
    bradley_terry_loss(chosen, rejected).backward()
    assert float(chosen.grad) == -0.5 and float(rejected.grad) == 0.5  # d/dx of -log sigmoid(x) at 0: -1/2


def test_accuracy_counts_ties_half_and_margin_is_the_mean_difference():
    accuracy, margin = pair_accuracy_and_margin(torch.tensor([2.0, 0.5, 0.0]), torch.tensor([0.0, 0.5, 1.0]))
    assert accuracy == pytest.approx((1 + 0.5 + 0) / 3) and margin == pytest.approx((2 + 0 - 1) / 3)


def test_pearson_correlation_by_hand():
    # x - mean = (-1, 0, 1), y - mean = (2 - 13/3, 4 - 13/3, 7 - 13/3) = (-7/3, -1/3, 8/3): sum of products 5,
    # sums of squares 2 and 114/9; r = 5 / sqrt(2 * 114/9) = 0.993399
    r = pearson_correlation(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 7.0]))
    assert r == pytest.approx(5 / math.sqrt(2 * 114 / 9)) and abs(r - 0.993399) < 1e-6
    assert pearson_correlation(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([7.0, 4.0, 2.0])) == pytest.approx(-r)
    assert math.isnan(pearson_correlation(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([5.0, 5.0, 5.0])))
