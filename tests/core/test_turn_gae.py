"""`turn_gae`: GAE over an episode's turns (the runs of True in the action mask), one advantage per turn.
Hand-worked values, a naive loop over random episodes, the cases where it equals `gae`, and the option."""

from __future__ import annotations

import pytest
import torch

from lmppo.apps.cli import main
from lmppo.config import Config, apply_override
from lmppo.core.advantages import ADVANTAGE_ESTIMATORS, gae, turn_gae
from lmppo.errors import ConfigError

T, F = True, False
NAN = float("nan")


def test_turn_gae_by_hand():
    """gamma 0.9, lambda 0.8 (gamma * lambda = 0.72); 9 and nan sit where the mask is False and must not matter.
    Row 0:  a a | o o | a a a | pad    turns at 0-1 and 4-6
      R = [0.5, -0.5 + 0 + 2 = 1.5], V (first tokens) = [1, 0.5]
      delta_2 = 1.5 - 0.5 = 1;              A_2 = 1
      delta_1 = 0.5 + 0.9 * 0.5 - 1 = -0.05; A_1 = -0.05 + 0.72 * 1 = 0.67
      returns A + V: 1.67, 1.5
    Row 1:  a | o | a a | o | a | pad pad  turns at 0, 2-3 and 5
      R = [1, 0.5 + 0.5 = 1, -1], V = [2, 1, 0.5]
      delta_3 = -1 - 0.5 = -1.5;           A_3 = -1.5
      delta_2 = 1 + 0.9 * 0.5 - 1 = 0.45;  A_2 = 0.45 + 0.72 * -1.5 = -0.63
      delta_1 = 1 + 0.9 * 1 - 2 = -0.1;    A_1 = -0.1 + 0.72 * -0.63 = -0.5536
      returns A + V: 1.4464, 0.37, -1.0"""
    mask = torch.tensor([[T, T, F, F, T, T, T, F], [T, F, T, T, F, T, F, F]])
    rewards = torch.tensor([[0, 0.5, 9, 9, -0.5, 0, 2, NAN], [1, 9, 0.5, 0.5, 9, -1, 9, NAN]])
    values = torch.tensor([[1, 3, 9, 9, 0.5, 4, 4, NAN], [2, 9, 1, 7, 9, 0.5, 9, NAN]])
    adv, ret = turn_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    expected_adv = [[0.67, 0.67, 0, 0, 1, 1, 1, 0], [-0.5536, 0, -0.63, -0.63, 0, -1.5, 0, 0]]
    expected_ret = [[1.67, 1.67, 0, 0, 1.5, 1.5, 1.5, 0], [1.4464, 0, 0.37, 0.37, 0, -1.0, 0, 0]]
    torch.testing.assert_close(adv, torch.tensor(expected_adv))
    torch.testing.assert_close(ret, torch.tensor(expected_ret))
    assert ADVANTAGE_ESTIMATORS["turn_gae"] is turn_gae


def _naive_turn_gae(rewards, values, mask, gamma, lam):
    """The recursion of the docstring, in Python over each row's turns."""
    adv, ret = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for b in range(mask.shape[0]):
        flags = mask[b].tolist()
        turns = []  # the positions of each run of True
        for t, on in enumerate(flags):
            if on and (t == 0 or not flags[t - 1]):
                turns.append([])
            if on:
                turns[-1].append(t)
        last, next_value = 0.0, 0.0
        for positions in reversed(turns):
            reward = sum(rewards[b, t].item() for t in positions)
            value = values[b, positions[0]].item()
            last = reward + gamma * next_value - value + gamma * lam * last
            next_value = value
            for t in positions:
                adv[b, t], ret[b, t] = last, last + value
    return adv, ret


def test_turn_gae_matches_the_naive_loop_over_random_episodes():
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(6, 13, generator=gen) < 0.6
    mask[:, 10:] &= torch.arange(6)[:, None] % 2 == 0  # padding on odd rows
    mask[5] = False  # a row with no policy token
    rewards, values = torch.randn(6, 13, generator=gen), torch.randn(6, 13, generator=gen)
    adv, ret = turn_gae(rewards, values, mask, gamma=0.95, lam=0.7)
    expected_adv, expected_ret = _naive_turn_gae(rewards, values, mask, 0.95, 0.7)
    assert (mask.sum(1) > 0).sum() == 5 and (mask[:, 1:] & ~mask[:, :-1]).sum(1).max() >= 3  # several turns
    torch.testing.assert_close(adv, expected_adv)
    torch.testing.assert_close(ret, expected_ret)


def test_a_single_response_is_one_turn():
    """A prefix mask: every real token gets R_total - V_first, whatever gamma and lambda; the return is R_total."""
    gen = torch.Generator().manual_seed(1)
    mask = torch.arange(7)[None, :] < torch.tensor([[7], [4]])
    rewards, values = torch.randn(2, 7, generator=gen), torch.randn(2, 7, generator=gen)
    adv, ret = turn_gae(rewards, values, mask, gamma=0.5, lam=0.3)
    total = (rewards * mask).sum(1, keepdim=True)
    torch.testing.assert_close(adv, torch.where(mask, total - values[:, :1], torch.zeros(1)))
    torch.testing.assert_close(ret, torch.where(mask, total.expand(2, 7), torch.zeros(1)))


def test_turn_gae_equals_gae_on_one_token_turns_and_its_returns_at_turn_starts_with_gamma_lambda_one():
    gen = torch.Generator().manual_seed(2)
    rewards, values = torch.randn(2, 9, generator=gen), torch.randn(2, 9, generator=gen)
    alternate = torch.tensor([[T, F] * 4 + [T], [F, T] * 4 + [F]])
    for got, want in zip(
        turn_gae(rewards, values, alternate, gamma=0.9, lam=0.8), gae(rewards, values, alternate, gamma=0.9, lam=0.8)
    ):
        torch.testing.assert_close(got, want)
    mask = torch.tensor([[T, T, F, T, T, T, F, T, F], [T, F, F, T, T, F, F, F, F]])
    starts = mask & ~torch.cat([torch.zeros(2, 1, dtype=torch.bool), mask[:, :-1]], 1)
    _, turn_ret = turn_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    _, token_ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(turn_ret[starts], token_ret[starts])
    assert not torch.allclose(turn_ret[mask], token_ret[mask])  # within a turn they differ


def test_config_accepts_turn_gae_and_help_lists_it(capsys):
    cfg = Config()
    apply_override(cfg, "ppo.advantage_estimator", "turn_gae")
    assert cfg.ppo.advantage_estimator == "turn_gae"
    with pytest.raises(ConfigError, match=r"`ppo.advantage_estimator` = 'turn_gea': .*`turn_gae`"):
        apply_override(cfg, "ppo.advantage_estimator", "turn_gea")
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--ppo.advantage_estimator {gae,turn_gae," in out
