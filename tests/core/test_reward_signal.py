"""No step from noise: which rows carry a reward signal, and the whitening floor. Hand-worked numbers."""

import math

import pytest
import torch

from lmppo.core.kl_control import PIKLController
from lmppo.core.masking import masked_whiten
from lmppo.core.rewards import score_range, signal_rows

INF = float("inf")


def test_score_range_over_the_batch_ignores_invalid_rows():
    scores = torch.tensor([0.0, 1.0, 0.5, 9.0])
    valid = torch.tensor([True, True, True, False])  # the 9.0 came from bad output: not compared
    highest, lowest = score_range(scores, valid, None)
    assert highest.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert lowest.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_score_range_per_group():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.3, 0.3000005, 7.0, 2.0])
    groups = torch.tensor([5, 5, 2, 2, 9, 9, 4, 4])
    valid = torch.tensor([True, True, True, True, True, True, True, False])
    highest, lowest = score_range(scores, valid, groups)
    assert highest.tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0, 0.3000005, 0.3000005, 7.0, 7.0])
    assert lowest.tolist() == pytest.approx([1.0, 1.0, 0.0, 0.0, 0.3, 0.3, 7.0, 7.0])


def test_signal_rows_tolerance_and_validity():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.3, 0.3000005, 7.0, 2.0])
    groups = torch.tensor([5, 5, 2, 2, 9, 9, 4, 4])
    valid = torch.tensor([True, True, True, True, True, True, True, False])
    highest, lowest = score_range(scores, valid, groups)
    # group 5: all 1 (no signal); group 2: 0 and 1; group 9: 5e-7 apart (within 1e-6); group 4: one valid row
    assert signal_rows(highest, lowest, valid, 1e-6).tolist() == [False, False, True, True, False, False, False, False]
    # tolerance 1e-7: group 9's half-millionth now counts
    assert signal_rows(highest, lowest, valid, 1e-7).tolist() == [False, False, True, True, True, True, False, False]


def test_all_equal_batch_has_no_signal_and_nothing_valid_has_none():
    valid = torch.ones(4, dtype=torch.bool)
    highest, lowest = score_range(torch.zeros(4), valid, None)
    assert not signal_rows(highest, lowest, valid, 0.0).any()  # spread 0 is not more than tolerance 0
    none_valid = torch.zeros(4, dtype=torch.bool)
    highest, lowest = score_range(torch.tensor([0.0, 1.0, 2.0, 3.0]), none_valid, None)
    assert highest[0].item() == -INF and lowest[0].item() == INF
    assert not signal_rows(highest, lowest, none_valid, 0.0).any()


def test_whitening_floor_does_not_inflate_small_advantages():
    # advantages +-0.01 around 0 (a critic that explains the reward up to 0.01): unbiased std = sqrt(2e-4 * 2 / 3)
    adv = torch.tensor([[0.01, -0.01, 0.01, -0.01]])
    mask = torch.ones_like(adv, dtype=torch.bool)
    std = math.sqrt(4 * 0.01**2 / 3)
    plain = masked_whiten(adv, mask, eps=0.0)
    assert plain[0].tolist() == pytest.approx([0.01 / std, -0.01 / std, 0.01 / std, -0.01 / std])  # +-0.866: inflated
    floored = masked_whiten(adv, mask, eps=0.0, min_std=0.5)  # the rewards' spread is 0.5
    assert floored[0].tolist() == pytest.approx([0.02, -0.02, 0.02, -0.02])  # divided by 0.5, not by 0.0115
    # a floor below the advantages' own spread changes nothing
    assert masked_whiten(adv, mask, eps=0.0, min_std=0.001)[0].tolist() == pytest.approx(plain[0].tolist())


def test_whitening_floor_keeps_the_mean_shift():
    adv = torch.tensor([[1.0, 1.02, 0.98, 5.0]])
    mask = torch.tensor([[True, True, True, False]])
    out = masked_whiten(adv, mask, eps=0.0, min_std=2.0)  # mean 1.0, std 0.02 < floor 2
    assert out[0].tolist() == pytest.approx([0.0, 0.01, -0.01, 0.0], abs=1e-7)


def test_pi_controller_winds_down_on_a_kl_of_zero():
    """The issue's sequence: KL 0 on target 5, beta 0.05. Each reading has e = -1 (clipped), the integral adds -1
    from the second reading on: log beta = log 0.05 - 1 + 0.5 * I. The trainer no longer feeds it such readings
    while the batch has no signal (tests/training/test_no_signal.py); this pins what it would do."""
    c = PIKLController(0.05, 5.0, kp=1.0, ki=0.5)
    seen = []
    for _ in range(5):
        c.update(0.0)
        seen.append(c.coef)
    expected = [0.05 * math.exp(-1 - 0.5 * i) for i in range(5)]  # 0.0184, 0.0112, 0.0068, 0.0041, 0.0025
    assert seen == pytest.approx(expected)
    assert seen[-1] == pytest.approx(0.0025, abs=1e-4)
