"""What GRPO users rely on, against values worked out by hand: the group advantage's scale (`ppo.grpo_scale`)."""

import math

import pytest
import torch

from lmppo.core.advantages import ADVANTAGE_ESTIMATORS, GROUP_SCALES


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


# two prompts, two responses each; totals a: 1, 3 (mean 2, population std 1); b: 0, 4 (mean 2, std 2)
# all four totals: mean 2, population variance (1 + 1 + 4 + 4) / 4 = 2.5
TOTALS_REWARDS = t([[0.0, 1.0], [3.0, 0.0], [0.0, 0.0], [1.0, 3.0]])
GROUPS = torch.tensor([0, 0, 1, 1])
SQRT_2_5 = math.sqrt(2.5)


@pytest.mark.parametrize(
    "scale, expected",
    [
        ("group", [-1 / (1 + 1e-6), 1 / (1 + 1e-6), -2 / (2 + 1e-6), 2 / (2 + 1e-6)]),
        ("batch", [-1 / (SQRT_2_5 + 1e-6), 1 / (SQRT_2_5 + 1e-6), -2 / (SQRT_2_5 + 1e-6), 2 / (SQRT_2_5 + 1e-6)]),
        ("none", [-1.0, 1.0, -2.0, 2.0]),
    ],
)
def test_grpo_scale_hand_worked(scale, expected):
    mask = torch.ones(4, 2, dtype=torch.bool)
    adv, ret = ADVANTAGE_ESTIMATORS["grpo"](
        TOTALS_REWARDS, torch.zeros(4, 2), mask, gamma=1.0, lam=1.0, group_ids=GROUPS, scale=scale
    )
    assert torch.allclose(adv[:, 0], t(expected), atol=1e-6)
    assert torch.equal(adv[:, 0], adv[:, 1])  # the same on every token of a response
    assert torch.allclose(ret, t([[1.0, 1.0], [3.0, 0.0], [0.0, 0.0], [4.0, 3.0]]))  # returns-to-go, any scale


def test_grpo_default_scale_is_the_group_std_bit_for_bit():
    mask = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    args = (TOTALS_REWARDS, torch.zeros(4, 2), mask)
    default, _ = ADVANTAGE_ESTIMATORS["grpo"](*args, gamma=1.0, lam=1.0, group_ids=GROUPS)
    totals = (TOTALS_REWARDS * mask).sum(1)
    mean = t([2.0, 2.0, 2.0, 2.0])
    std = t([1.0, 1.0, 2.0, 2.0])  # [1, 3] and [0, 4]: population std 1 and 2 (masked: 1 and 3, 0 and 4 again)
    by_hand = ((totals - mean) / (std + 1e-6))[:, None].expand(4, 2)
    assert torch.equal(default, torch.where(mask, by_hand, torch.zeros(4, 2)))


def test_grpo_batch_scale_reads_the_given_batch_std():
    """`batch_std`: the trainer passes the std over every process's rows; the estimator divides by exactly it."""
    mask = torch.ones(4, 2, dtype=torch.bool)
    seen = []

    def over_processes(totals):
        seen.append(totals.tolist())
        return torch.tensor(4.0)

    adv, _ = ADVANTAGE_ESTIMATORS["grpo"](
        TOTALS_REWARDS,
        torch.zeros(4, 2),
        mask,
        gamma=1.0,
        lam=1.0,
        group_ids=GROUPS,
        scale="batch",
        batch_std=over_processes,
    )
    assert seen == [[1.0, 3.0, 0.0, 4.0]]
    assert torch.allclose(adv[:, 0], t([-1.0, 1.0, -2.0, 2.0]) / (4.0 + 1e-6))


def test_grpo_scales_are_the_documented_three():
    assert sorted(GROUP_SCALES) == ["batch", "group", "none"]
    assert ADVANTAGE_ESTIMATORS.trait("grpo", "group_scale") is True
    assert not any(ADVANTAGE_ESTIMATORS.trait(n, "group_scale") for n in ("gae", "rloo", "reinforce_pp"))
