"""What GRPO users rely on, against values worked out by hand: the group advantage's scale (`ppo.grpo_scale`), the
loss aggregation (`ppo.loss_aggregation`), the overlong penalty (`reward.overlong_buffer`)."""

import math
import typing

import pytest
import torch

from lmppo.config.schema import PPOConfig
from lmppo.core.advantages import ADVANTAGE_ESTIMATORS, GROUP_SCALES
from lmppo.core.losses import LOSS_AGGREGATIONS
from lmppo.core.rewards import add_on_last_token, overlong_penalty


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


def test_the_config_offers_exactly_the_core_names():
    """The schema's choices (the config layer imports no torch, so it lists them) are the core tables' keys."""
    hints = typing.get_type_hints(PPOConfig)
    assert set(typing.get_args(hints["grpo_scale"])) == set(GROUP_SCALES) == {"batch", "group", "none"}
    assert set(typing.get_args(hints["loss_aggregation"])) == set(LOSS_AGGREGATIONS)
    assert ADVANTAGE_ESTIMATORS.trait("grpo", "group_scale") is True
    assert not any(ADVANTAGE_ESTIMATORS.trait(n, "group_scale") for n in ("gae", "rloo", "reinforce_pp"))


# ---------------------------------------------------------------- loss aggregation (`ppo.loss_aggregation`)
# rows: [4] | [1, 3] | [3, 3, 9] | nothing (a dropped row); token sum 4 + 4 + 15 = 23 over 6 tokens;
# row means 4, 2, 5 over 3 sequences; with a longest response of 4 the budget is 3 x 4 = 12 tokens
PER_TOKEN = t([[4.0, 99.0, 99.0, 99.0], [1.0, 3.0, 99.0, 99.0], [3.0, 3.0, 9.0, 99.0], [7.0, 7.0, 7.0, 7.0]])
LOSS_MASK = torch.arange(4)[None] < torch.tensor([1, 2, 3, 0])[:, None]


@pytest.mark.parametrize(
    "name, denominator, loss",
    [("token_mean", 6.0, 23 / 6), ("sequence_mean", 3.0, (4 + 2 + 5) / 3), ("fixed_length", 12.0, 23 / 12)],
)
def test_loss_aggregation_hand_worked(name, denominator, loss):
    aggregation = LOSS_AGGREGATIONS[name]
    assert aggregation.denominator(LOSS_MASK, 4).item() == denominator
    assert aggregation.share(PER_TOKEN, LOSS_MASK, denominator).item() == pytest.approx(loss, rel=1e-6)


@pytest.mark.parametrize("name", sorted(LOSS_AGGREGATIONS))
def test_loss_aggregation_is_invariant_to_micro_batch_split(name):
    g = torch.Generator().manual_seed(1)
    B, T = 8, 9
    per_token = torch.randn(B, T, generator=g)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = 0  # a row without a training token (dropped) adds nothing and counts in no denominator
    mask = torch.arange(T)[None] < lengths[:, None]
    aggregation = LOSS_AGGREGATIONS[name]
    full = aggregation.share(per_token, mask, aggregation.denominator(mask, T))
    for split in (1, 2, 4, 8):
        # each process / micro-batch: its share with the minibatch's denominator (the sum of the parts' counts)
        denominator = sum(aggregation.denominator(mask[i : i + split], T) for i in range(0, B, split))
        total = sum(
            aggregation.share(per_token[i : i + split], mask[i : i + split], denominator) for i in range(0, B, split)
        )
        assert torch.allclose(total, full, atol=1e-6)


# ---------------------------------------------------------------- overlong penalty (`reward.overlong_buffer`)
def test_overlong_penalty_hand_worked():
    # L_max 10, buffer 4, penalty 1: free up to 6 tokens, then -1/4 per token, -1 at 10
    lengths = torch.tensor([1, 6, 7, 8, 9, 10])
    assert overlong_penalty(lengths, 10, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0]
    assert overlong_penalty(lengths, 10, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.375, -0.5]
    # buffer = L_max: the penalty grows from the first token, -L / L_max
    assert overlong_penalty(torch.tensor([0, 5, 10]), 10, 10, 1.0).tolist() == [0.0, -0.5, -1.0]
    assert overlong_penalty(lengths, 10, 0, 1.0).tolist() == [0.0] * 6  # off


def test_the_penalty_lands_on_each_responses_last_token():
    scores = t([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    out = add_on_last_token(scores, mask, t([-0.5, -0.25]))
    assert out.tolist() == [[0.0, 1.0, -0.5], [1.75, 0.0, 0.0]]
