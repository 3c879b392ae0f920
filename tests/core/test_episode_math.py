"""Multi-turn episodes in the core math: the action mask, per-turn reward placement, GAE that skips the
environment's tokens, and the KL / losses masked by the action mask. Hand-worked values.

The worked episode (response positions 0..7):  a0 a1 | o2 o3 o4 | a5 a6 | pad7
  turn 1 = positions 0-1 (reward 0.5), observation 2-4, turn 2 = positions 5-6 (reward 1.0), padding at 7.
"""

from __future__ import annotations

import torch

from lmppo.core.advantages import ADVANTAGE_ESTIMATORS, gae
from lmppo.core.kl import kl_k1
from lmppo.core.logprobs import selective_log_softmax
from lmppo.core.masking import action_mask, compaction_order, last_true_index, masked_mean
from lmppo.core.objective import ppo_objective
from lmppo.core.rewards import kl_penalized_rewards, place_turn_rewards

STARTS = torch.tensor([[0, 5]])
ENDS = torch.tensor([[1, 6]])
WIDTH = 8
ACTION = torch.tensor([[True, True, False, False, False, True, True, False]])


def test_action_mask_is_the_union_of_the_turns_spans():
    assert torch.equal(action_mask(STARTS, ENDS, WIDTH), ACTION)
    # a row with one turn only (-1 for the turn it lacks), next to the two-turn row
    starts = torch.tensor([[0, 5], [0, -1]])
    ends = torch.tensor([[1, 6], [2, -1]])
    mask = action_mask(starts, ends, WIDTH)
    assert mask[1].tolist() == [True, True, True, False, False, False, False, False]


def test_last_true_index_of_an_action_mask_is_the_last_policy_token():
    assert last_true_index(ACTION).tolist() == [6]
    assert last_true_index(torch.tensor([[True, True, False], [False, False, False]])).tolist() == [1, -1]


def test_compaction_order_is_the_identity_for_a_prefix_mask_and_packs_an_action_mask():
    prefix = torch.tensor([[True, True, True, False]])
    assert compaction_order(prefix).tolist() == [[0, 1, 2, 3]]
    assert compaction_order(ACTION).tolist() == [[0, 1, 5, 6, 2, 3, 4, 7]]


def test_turn_rewards_sit_on_each_turns_last_policy_token():
    rewards = place_turn_rewards(ENDS, torch.tensor([[0.5, 1.0]]), WIDTH)
    assert rewards.tolist() == [[0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]
    # a missing turn (-1) adds nothing anywhere
    rewards = place_turn_rewards(torch.tensor([[1, -1]]), torch.tensor([[0.5, 7.0]]), 4)
    assert rewards.tolist() == [[0.0, 0.5, 0.0, 0.0]]


def test_gae_over_a_two_turn_episode_by_hand():
    """gamma 1, lambda 0.5, V 0.5 on policy tokens (the observation's values, 9, must not matter).
    Over the policy tokens a0 a1 a5 a6: rewards [0, .5, 0, 1], deltas [0, .5, 0, .5]
    A(a6) = .5;  A(a5) = 0 + .5 * .5 = .25;  A(a1) = .5 + .5 * .25 = .625;  A(a0) = .5 * .625 = .3125
    returns = A + V = [.8125, 1.125, .75, 1.0]; the observation and padding get 0."""
    rewards = place_turn_rewards(ENDS, torch.tensor([[0.5, 1.0]]), WIDTH)
    rewards[0, 3] = 5.0  # a reward on an observation token is ignored
    values = torch.tensor([[0.5, 0.5, 9.0, 9.0, 9.0, 0.5, 0.5, 9.0]])
    adv, ret = gae(rewards, values, ACTION, gamma=1.0, lam=0.5)
    assert torch.allclose(adv, torch.tensor([[0.3125, 0.625, 0, 0, 0, 0.25, 0.5, 0]]))
    assert torch.allclose(ret, torch.tensor([[0.8125, 1.125, 0, 0, 0, 0.75, 1.0, 0]]))


def test_gae_carries_one_gamma_across_the_observation():
    """gamma 0.5, lambda 1, V 0: A(a6) = 1, A(a5) = .5, A(a1) = .5 * .5 = .25 (one gamma from a5, not four),
    A(a0) = .125."""
    rewards = place_turn_rewards(ENDS[:, 1:], torch.tensor([[1.0]]), WIDTH)
    adv, _ = gae(rewards, torch.zeros(1, WIDTH), ACTION, gamma=0.5, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[0.125, 0.25, 0, 0, 0, 0.5, 1.0, 0]]))


def _naive_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    out, last = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        last = rewards[t] + gamma * next_value - values[t] + gamma * lam * last
        out[t] = last
    return out


def test_inserting_observation_tokens_leaves_the_advantages_unchanged():
    """The invariance: an episode's policy tokens alone (a prefix mask) and the same tokens with observation spans
    of random lengths and random values/rewards inserted between them give the same advantages and returns, and
    those equal the naive loop over the policy tokens."""
    gen = torch.Generator().manual_seed(0)
    n = 9
    rewards, values = torch.randn(1, n, generator=gen), torch.randn(1, n, generator=gen)
    plain_mask = torch.ones(1, n, dtype=torch.bool)
    adv_plain, ret_plain = gae(rewards, values, plain_mask, gamma=0.9, lam=0.8)
    expected = _naive_gae(rewards[0].tolist(), values[0].tolist(), 0.9, 0.8)
    assert torch.allclose(adv_plain[0], torch.tensor(expected), atol=1e-6)
    # insert observation spans after tokens 2, 5 and 6 (lengths 3, 1, 4) and padding at the end
    pieces_r, pieces_v, pieces_m = [], [], []
    for t in range(n):
        pieces_r.append(rewards[:, t : t + 1])
        pieces_v.append(values[:, t : t + 1])
        pieces_m.append(torch.ones(1, 1, dtype=torch.bool))
        span = {2: 3, 5: 1, 6: 4}.get(t, 0) + (2 if t == n - 1 else 0)
        if span:
            pieces_r.append(torch.randn(1, span, generator=gen) * 100)
            pieces_v.append(torch.randn(1, span, generator=gen) * 100)
            pieces_m.append(torch.zeros(1, span, dtype=torch.bool))
    r_ep, v_ep, m_ep = torch.cat(pieces_r, 1), torch.cat(pieces_v, 1), torch.cat(pieces_m, 1)
    for name in ("gae", "reinforce_pp"):
        adv_ep, ret_ep = ADVANTAGE_ESTIMATORS[name](r_ep, v_ep, m_ep, gamma=0.9, lam=0.8)
        adv_ref, ret_ref = ADVANTAGE_ESTIMATORS[name](rewards, values, plain_mask, gamma=0.9, lam=0.8)
        assert torch.allclose(adv_ep[m_ep], adv_ref[0], atol=1e-6), name
        assert torch.allclose(ret_ep[m_ep], ret_ref[0], atol=1e-6), name
        assert (adv_ep[~m_ep] == 0).all() and (ret_ep[~m_ep] == 0).all(), name


def test_group_estimators_count_the_policy_tokens_rewards_only():
    """rloo/grpo over two episodes of one prompt: the totals are the turn rewards (1.5 and 0.5), not the reward
    sitting on an observation token. rloo: A = 1.5 - 0.5 = 1 and -1 on every policy token, 0 on observations."""
    mask = torch.cat([ACTION, ACTION])
    rewards = torch.cat(
        [
            place_turn_rewards(ENDS, torch.tensor([[0.5, 1.0]]), WIDTH),
            place_turn_rewards(ENDS, torch.tensor([[0.5, 0.0]]), WIDTH),
        ]
    )
    rewards[:, 3] = 10.0  # on the observation: ignored
    adv, _ = ADVANTAGE_ESTIMATORS["rloo"](
        rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=1.0, group_ids=torch.tensor([0, 0])
    )
    assert torch.allclose(adv, torch.where(mask, torch.tensor([[1.0], [-1.0]]), torch.zeros(1)))
    adv, _ = ADVANTAGE_ESTIMATORS["grpo"](
        rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=1.0, group_ids=torch.tensor([0, 0])
    )
    assert torch.allclose(adv[mask], torch.tensor([1.0] * 4 + [-1.0] * 4), atol=1e-5)


def test_kl_of_an_episode_counts_the_policy_tokens_only():
    """k1 per token = log p - log p_ref: on the policy tokens 0.1, 0.2, 0.3, 0.4; the observation tokens carry
    large values (the policy never chose them). Penalised rewards (beta 0.5) are -0.05, -0.1, -0.15, -0.2 on the
    policy tokens and 0 elsewhere; the mean KL is 0.25 (over 4 tokens, not 8); the episode's KL (sum) is 1.0."""
    logprobs = torch.tensor([[-1.0, -1.0, -9.0, -9.0, -9.0, -1.0, -1.0, 0.0]])
    ref = torch.tensor([[-1.1, -1.2, 0.0, 0.0, 0.0, -1.3, -1.4, 0.0]])
    kl = kl_k1(logprobs, ref)
    rewards = kl_penalized_rewards(torch.zeros_like(kl), kl, 0.5, ACTION)
    assert torch.allclose(rewards, torch.tensor([[-0.05, -0.1, 0, 0, 0, -0.15, -0.2, 0]]), atol=1e-6)
    assert torch.isclose(masked_mean(kl, ACTION), torch.tensor(0.25), atol=1e-6)
    assert torch.isclose(torch.where(ACTION, kl, torch.zeros_like(kl)).sum(), torch.tensor(1.0), atol=1e-6)


def test_ppo_objective_over_an_episode_ignores_the_observation_tokens():
    """At the rollout's weights (ratio 1) and with values equal to the returns, the loss is the policy term only:
    -mean(A) over the 4 policy tokens = -(.3125 + .625 + .25 + .5) / 4 = -0.421875. Advantages, returns, logprobs
    and values of 100 on the observation tokens change nothing; the KL term (k3, coef 1, reference = policy) is 0."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, WIDTH, 11, generator=gen)
    ids = torch.randint(0, 11, (1, WIDTH), generator=gen)
    old = selective_log_softmax(logits, ids)
    adv = torch.tensor([[0.3125, 0.625, 100, 100, 100, 0.25, 0.5, 100]])
    returns = torch.tensor([[0.8125, 1.125, 100, 100, 100, 0.75, 1.0, 100]])
    values = returns.clone()
    values[~ACTION] = -100.0
    old_bad = torch.where(ACTION, old, torch.full_like(old, 100.0))
    loss, stats = ppo_objective(
        logits, values, ids, old_bad, values, adv, returns, ACTION, ACTION.sum(),
        clip_range=0.2, value_clip_range=0.2, vf_coef=0.1, entropy_coef=0.0, kl_coef=1.0, kl_estimator="k3",
        ref_logprobs=old_bad,
    )  # fmt: skip
    assert torch.isclose(loss, torch.tensor(-0.421875), atol=1e-6)
    assert float(stats["val/ratio"]) == 1.0
    assert float(stats["loss/kl_avg"]) == 0.0
