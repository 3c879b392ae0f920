"""Truncated responses handled on purpose: the four `reward.truncation` policies through the trainer's phases 2-4.

Uses the hand rollout of `test_rewards_e2e` (row 1, "Bad movie!", hit max_new_tokens = 4 without the stop token;
rows 0 and 2 ended with EOS), with kl.coef = 0.1 and the per-token KL there. Values are 1 on every real token
and V(state after the last token) (`final_values`) is [7, 2, 7]: 7 on the terminated rows must never be used.

none: a cut response is scored as if finished. penalty: the EOS trick, after normalisation. bootstrap: the cut
response did not finish, so its scalar scores go and gamma * V(s_T) comes instead (its per-token and span scores
stay). drop: no policy or value gradient from cut responses.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_rewards_e2e import (
    KL_PART,
    base_config,
    constant,
    dropped_rows_get_no_gradient,
    hand_rollout,
    make_trainer,
    phases_2_3,
    source,
    t,
)

from conftest import PROMPTS, tiny_llama
from lmppo.errors import ConfigError
from lmppo.training.trainer import PPOTrainer

PER_TOKEN = [[1.0, -1.0, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25], [2.0, -2.0, 0.0]]
PER_TOKEN_REWARDS = [[0.99, -1.02, 0.47, -0.04], [0.20, 0.24, 0.23, 0.22], [1.98, -2.02, -0.01, 0.0]]


@pytest.mark.parametrize(
    "policy, extra, row1_scores, row1_rewards",
    [
        ("none", {}, [0.25, 0.25, 0.25, 0.25], [0.20, 0.24, 0.23, 0.22]),
        # the EOS trick: the whole placed score of the cut row is replaced by the penalty on its last token
        ("penalty", {"reward__penalty_mode": "replace"}, [0, 0, 0, -1.0], [-0.05, -0.01, -0.02, -1.03]),
        ("penalty", {"reward__penalty_mode": "add"}, [0.25, 0.25, 0.25, -0.75], [0.20, 0.24, 0.23, -0.78]),
        # bootstrap keeps per-token scores (rewards the tokens earned) and adds gamma * V(s_T) = 1 * 2; drop keeps them
        ("bootstrap", {}, [0.25, 0.25, 0.25, 0.25], [0.20, 0.24, 0.23, 2.22]),
        ("drop", {}, [0.25, 0.25, 0.25, 0.25], [0.20, 0.24, 0.23, 0.22]),
    ],
)
def test_each_policy_on_per_token_scores(tmp_path, tokenizer, policy, extra, row1_scores, row1_rewards):
    trainer = make_trainer(
        tmp_path, tokenizer, [constant(PER_TOKEN)], reward__truncation=policy, reward__penalty=-1.0, **extra
    )
    rollout = hand_rollout(tokenizer)
    scored, rewards = phases_2_3(trainer, rollout)
    expected_scores = [[1.0, -1.0, 0.5, 0.0], row1_scores, [2.0, -2.0, 0.0, 0.0]]
    assert torch.allclose(scored.token_scores, t(expected_scores))
    expected = [PER_TOKEN_REWARDS[0], row1_rewards, PER_TOKEN_REWARDS[2]]  # terminated rows never change
    assert torch.allclose(rewards.rewards, t(expected))
    keep_row1 = policy != "drop"
    assert rewards.train_mask[1].tolist() == [keep_row1] * 4
    assert torch.equal(rewards.train_mask[[0, 2]], rollout.response_mask[[0, 2]])


def test_penalty_on_a_scalar_score(tmp_path, tokenizer):
    trainer = make_trainer(
        tmp_path, tokenizer, [constant([1.0, 2.0, -1.0])], reward__truncation="penalty", reward__penalty=-3.0
    )
    scored, rewards = phases_2_3(trainer, hand_rollout(tokenizer))
    assert torch.allclose(scored.token_scores, t([[0, 0, 0, 1.0], [0, 0, 0, -3.0], [0, 0, -1.0, 0]]))
    assert torch.allclose(scored.raw_scores, t([1.0, 2.0, -1.0]))  # what the reward said, for the metrics


def test_penalty_comes_after_normalisation(tmp_path, tokenizer):
    """`reward.penalty` is the score a cut response gets, in the units the trainer uses: the running statistics
    see the reward's own totals [1, 1, 4] (mean 2, std sqrt 2), the cut row then scores exactly the penalty."""
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        [constant([1.0, 1.0, 4.0])],
        reward__truncation="penalty",
        reward__penalty=-1.0,
        reward__normalize=True,
    )
    scored = trainer.score(hand_rollout(tokenizer))
    s = math.sqrt(2)
    assert torch.allclose(scored.token_scores, t([[0, 0, 0, -1 / s], [0, 0, 0, -1.0], [0, 0, 2 / s, 0]]), atol=1e-6)
    assert trainer.score_moments.mean == pytest.approx(2.0)


def test_bootstrap_rewards_and_gae_by_hand(tmp_path, tokenizer):
    """gamma = 0.5, lambda = 1, values 1 on every real token, V(s_T) = 2 for the cut row 1, scalar scores [1, 2, -1].

    row 1 did not finish: its scalar score 2 (a judgement of it as a finished response) is taken off, and
    gamma * V(s_T) = 0.5 * 2 = 1 goes on its last token: rewards = KL part [-.05 -.01 -.02 -.03] + [0 0 0 1]
                   -> [-.05, -.01, -.02, .97]
    deltas d_t = r_t + .5 V_{t+1} - V_t (V_4 = 0: the bootstrap is already in r_3):
                   d_3 = .97 - 1 = -.03; d_2 = -.02 + .5 - 1 = -.52; d_1 = -.51; d_0 = -.55
    A_t = d_t + .5 A_{t+1}:  A_3 = -.03, A_2 = -.52 - .015 = -.535, A_1 = -.51 - .2675 = -.7775,
                             A_0 = -.55 - .38875 = -.93875
    returns A + V = [.06125, .2225, .465, .97]; check: R_0 = -.05 - .005 - .005 - .00375 + .0625 * 2 = .06125.
    row 0 is terminated: its V(s_T) = 7 is ignored; rewards [-.01 -.02 -.03 .96] -> A = [-.9075, -.795, -.55, -.04].
    """
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        [constant([1.0, 2.0, -1.0])],
        reward__truncation="bootstrap",
        ppo__gamma=0.5,
        ppo__lam=1.0,
        ppo__whiten_advantages=False,
    )
    rollout = hand_rollout(tokenizer)
    scored, rewards = phases_2_3(trainer, rollout)
    assert torch.allclose(scored.token_scores, t([[0, 0, 0, 1.0], [0, 0, 0, 0], [0, 0, -1.0, 0]]))
    assert torch.allclose(scored.raw_scores, t([1.0, 2.0, -1.0]))  # what the reward said, for the metrics
    assert torch.allclose(
        rewards.rewards, t([[-0.01, -0.02, -0.03, 0.96], [-0.05, -0.01, -0.02, 0.97], [-0.02, -0.02, -1.01, 0.0]])
    )
    advantages, returns = trainer.advantages(rollout, rewards)
    assert torch.allclose(advantages[1], t([-0.93875, -0.7775, -0.535, -0.03]))
    assert torch.allclose(returns[1], t([0.06125, 0.2225, 0.465, 0.97]))
    assert torch.allclose(advantages[0], t([-0.9075, -0.795, -0.55, -0.04]))
    assert returns[2, 3] == 0 and advantages[2, 3] == 0  # padding (value 5 there) changes nothing

    # the same rollout without bootstrap: only the cut row's last reward (and so its advantages) differ
    plain = make_trainer(
        tmp_path / "plain",
        tokenizer,
        [constant([1.0, 2.0, -1.0])],
        ppo__gamma=0.5,
        ppo__lam=1.0,
        ppo__whiten_advantages=False,
    )
    plain_rewards = plain.token_rewards(rollout, plain.score(rollout))
    assert torch.allclose(rewards.rewards - plain_rewards.rewards, t([[0, 0, 0, 0], [0, 0, 0, -2 + 1.0], [0, 0, 0, 0]]))


def test_unfinished_scores_by_hand():
    """The pure function behind bootstrap's scores: cut rows keep placed scores minus their scalar part, / scale."""
    from lmppo.core.rewards import unfinished_scores

    placed = t([[0.5, 0.5, 3.0], [1.0, 2.0, 0.0]])  # row 0: per-token .5 .5 (+.. ) and a scalar 2 on its last token
    mask = torch.tensor([[True, True, True], [True, True, False]])
    normalised = t([[9.0, 9.0, 9.0], [8.0, 8.0, 0.0]])  # whatever normalisation made of them
    out = unfinished_scores(normalised, placed, mask, torch.tensor([True, False]), t([2.0, 5.0]), scale=2.0)
    assert torch.allclose(out, t([[0.25, 0.25, 0.5], [8.0, 8.0, 0.0]]))


def test_bootstrap_keeps_per_token_and_span_scores_of_a_cut_response(tmp_path, tokenizer):
    """Per-token and span scores are rewards the cut response's tokens earned; only the scalar part goes.
    Sources: a scalar [1, 2, -1] (weight 2) and per-token lists (weight 1); gamma 1, V(s_T) = 2."""
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        [constant([1.0, 2.0, -1.0], name="s", weight=2.0), constant(PER_TOKEN, name="p")],
        reward__truncation="bootstrap",
    )
    scored, rewards = phases_2_3(trainer, hand_rollout(tokenizer))
    assert torch.allclose(
        scored.token_scores, t([[1.0, -1.0, 0.5, 2.0], [0.25, 0.25, 0.25, 0.25], [2.0, -2.0, -2.0, 0.0]])
    )
    assert torch.allclose(rewards.rewards[1], t([0.20, 0.24, 0.23, 0.22 + 2.0]))
    assert torch.allclose(scored.per_source["s"], t([1.0, 2.0, -1.0]))  # still logged as the reward said


def test_bootstrap_with_normalisation(tmp_path, tokenizer):
    """Totals [1 + 1, 2 + 1, -1 + 0] = [2, 3, -1] (scalar + per-token [.5 .5 0 0] / [.25 x4] / [0 0 0]): mean 4/3,
    population variance (4/9 + 25/9 + 49/9) / 3 = 26/9, std s = sqrt(26)/3. The cut row 1 keeps its per-token
    scores divided by s, without its scalar 2 and without the normalisation shift."""
    per_token = [[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.0]]
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        [constant([1.0, 2.0, -1.0], name="s"), constant(per_token, name="p")],
        reward__truncation="bootstrap",
        reward__normalize=True,
    )
    scored = trainer.score(hand_rollout(tokenizer))
    s = math.sqrt(26) / 3
    assert trainer.score_moments.std == pytest.approx(s)
    assert torch.allclose(scored.token_scores[1], t([0.25, 0.25, 0.25, 0.25]) / s, atol=1e-6)
    assert torch.allclose(scored.token_scores.sum(1)[[0, 2]], t([(2 - 4 / 3) / s, (-1 - 4 / 3) / s]), atol=1e-6)


@pytest.mark.parametrize("value_mode", ["shared", "critic"])
def test_final_values_are_the_value_of_the_state_after_the_last_token(tmp_path, tokenizer, value_mode):
    """collect_rollout's final_values[i] (used by bootstrap) equals V(prompt + whole response) from a separate
    forward pass of that row alone, unpadded."""
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        [source(lambda p, c: [0.0] * len(c))],
        value__mode=value_mode,
        rollout__batch_size=8,
        rollout__max_new_tokens=3,
    )
    rollout = trainer.collect_rollout()
    assert rollout.truncated.any()
    critic = trainer.accelerator.unwrap_model(trainer.critic) if trainer.critic is not None else None
    for i in range(rollout.batch_size):
        prompt = rollout.prompt_ids[i][rollout.prompt_mask[i]]
        response = rollout.response_ids[i][rollout.response_mask[i]]
        ids = torch.cat([prompt, response])[None]
        att = torch.ones_like(ids, dtype=torch.bool)
        with torch.no_grad():
            values = (
                critic(ids, att, len(prompt))
                if critic is not None
                else trainer.actor(ids, att, len(prompt), 1.0).values
            )
        assert values.shape[1] == len(response) + 1
        assert torch.allclose(rollout.final_values[i], values[0, -1], atol=1e-5)
        assert torch.allclose(rollout.values[i][rollout.response_mask[i]], values[0, :-1], atol=1e-5)


def test_drop_gives_cut_rows_no_policy_or_value_gradient(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, [constant(PER_TOKEN)], reward__truncation="drop")
    rollout = hand_rollout(tokenizer)
    _, rewards = phases_2_3(trainer, rollout)
    assert rewards.train_mask.tolist() == [[True] * 4, [False] * 4, [True, True, True, False]]
    advantages, _ = trainer.advantages(rollout, rewards)  # whitened over the kept tokens only
    assert torch.all(advantages[1] == 0)
    kept = rewards.train_mask
    assert advantages[kept].mean().abs() < 1e-6 and advantages[kept].std() == pytest.approx(1.0, abs=1e-5)
    assert dropped_rows_get_no_gradient(trainer, rollout, rewards, dropped=[1])


def test_drop_without_any_truncation_changes_nothing(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, [constant(PER_TOKEN)], reward__truncation="drop")
    rollout = hand_rollout(tokenizer)
    rollout.truncated = torch.zeros(3, dtype=torch.bool)
    _, rewards = phases_2_3(trainer, rollout)
    assert torch.equal(rewards.train_mask, rollout.response_mask)


@pytest.mark.parametrize("policy", ["none", "penalty", "bootstrap", "drop"])
def test_every_policy_trains_on_sampled_rollouts(tmp_path, tokenizer, policy):
    """Two iterations with short responses (most are cut): finite metrics, the cut count logged per policy."""
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        [source(lambda p, cs: [len(c) / 10 for c in cs], "length")],
        reward__truncation=policy,
        rollout__batch_size=8,
        rollout__max_new_tokens=3,
        ppo__micro_batch_size=4,
        iterations=2,
        ppo__num_epochs=2,
    )
    history = trainer.train()
    for m in history:
        assert all(math.isfinite(v) for v in m.values())
        cut = m[f"truncation/{policy}_count"]
        assert cut == pytest.approx(m["response/truncated_frac"] * 8)
    assert sum(m[f"truncation/{policy}_count"] for m in history) > 0


def test_truncation_policies_need_a_stop_token(tmp_path, tokenizer):
    cfg = base_config(tmp_path, rollout__stop_token="none", reward__truncation="penalty")
    with pytest.raises(ConfigError, match="reward.truncation"):
        PPOTrainer(
            cfg,
            policy=tiny_llama(tokenizer),
            tokenizer=tokenizer,
            prompts=PROMPTS,
            reward_functions=[lambda p, c: [0.0] * len(c)],
        )


def test_kl_part_is_the_same_under_every_policy(tmp_path, tokenizer):
    """The truncation policy never touches the KL penalty: with a zero score, rewards are the KL part except for
    bootstrap's gamma * V on the cut row's last token and penalty's penalty there."""
    for policy, row1_last in [("none", -0.03), ("drop", -0.03), ("bootstrap", -0.03 + 2.0), ("penalty", -0.03 - 1)]:
        trainer = make_trainer(tmp_path / policy, tokenizer, [constant([0.0, 0.0, 0.0])], reward__truncation=policy)
        _, rewards = phases_2_3(trainer, hand_rollout(tokenizer))
        expected = t(KL_PART)
        expected[1, 3] = row1_last
        assert torch.allclose(rewards.rewards, expected), policy
