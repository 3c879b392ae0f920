"""What GRPO users rely on, end to end on tiny in-process models: each option changes what the trainer does (a
test here fails when the option is not passed on)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import PROMPTS, small_config, tiny_llama
from lmppo.training.trainer import PPOTrainer

GRPO = {"ppo__advantage_estimator": "grpo", "rollout__num_samples_per_prompt": 4, "ppo__whiten_advantages": False}


def length_reward(prompts, completions):
    return [len(c) / 20.0 for c in completions]


def make(tmp_path, tokenizer, reward=length_reward, iterations=1, **fields) -> PPOTrainer:
    cfg = small_config(tmp_path / "run", iterations, 8, kl__controller="fixed", kl__coef=0.0, **fields)
    return PPOTrainer(
        cfg, policy=tiny_llama(tokenizer, seed=1), tokenizer=tokenizer, prompts=PROMPTS, reward_functions=[reward]
    )


def first_batch(trainer):
    torch.manual_seed(0)
    rollout = trainer.collect_rollout()
    rewards = trainer.token_rewards(rollout, trainer.score(rollout))
    return rollout, rewards


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_scale_sets_the_trainers_advantages(tmp_path, tokenizer, scale):
    """The trainer's advantages are the group-centred totals divided as `ppo.grpo_scale` says, worked out here from
    the batch's rewards; and one update from the same batch moves the policy differently for each scale."""
    trainer = make(tmp_path, tokenizer, **GRPO, ppo__grpo_scale=scale)
    rollout, rewards = first_batch(trainer)
    adv, _ = trainer.advantages(rollout, rewards)
    totals = (rewards.rewards * rollout.policy_mask).sum(1)  # (B,)
    groups = totals.view(-1, 4)  # 4 responses per prompt, consecutive
    centred = (groups - groups.mean(1, keepdim=True)).flatten()
    divisor = {
        "group": groups.std(1, unbiased=False).repeat_interleave(4) + 1e-6,
        "batch": totals.std(unbiased=False) + 1e-6,
        "none": torch.ones(()),
    }[scale]
    expected = torch.where(rewards.signal.rows, centred / divisor, torch.zeros_like(centred))
    assert centred.abs().max() > 0.05  # the lengths differ: a signal to scale
    assert torch.allclose(adv[:, 0], expected, atol=1e-5)


def test_grpo_scale_changes_the_update(tmp_path, tokenizer):
    weights = {}
    for scale in ("group", "none"):
        trainer = make(tmp_path / scale, tokenizer, **GRPO, ppo__grpo_scale=scale)
        torch.manual_seed(0)
        trainer.train()
        weights[scale] = torch.cat([p.detach().flatten() for p in trainer.policy.parameters()])
    assert not torch.allclose(weights["group"], weights["none"])


def test_loss_aggregation_sets_the_minibatch_loss(tmp_path, tokenizer):
    """The trainer's loss of one batch under each `ppo.loss_aggregation`, against its own per-token losses weighted
    by hand: token_mean = sum / tokens, sequence_mean = mean of row means, fixed_length = sum / (rows x 6 tokens)."""
    from lmppo.training.metrics import MetricsAccumulator
    from lmppo.training.update import UpdateBatch, minibatch_denominator

    losses, per_row = {}, None
    for aggregation in ("token_mean", "sequence_mean", "fixed_length"):
        trainer = make(tmp_path / aggregation, tokenizer, **GRPO, ppo__loss_aggregation=aggregation)
        rollout, rewards = first_batch(trainer)
        adv, ret = trainer.advantages(rollout, rewards)
        lengths = torch.tensor([1, 6, 2, 5, 3, 4, 6, 2])  # the tiny model rarely stops: cut the rows to differ
        mask = rewards.train_mask & (torch.arange(rewards.train_mask.shape[1])[None] < lengths[:, None])
        rollout.logprobs = rollout.logprobs + 0.3  # ratios e^-0.3 on every token: each token's loss is -A e^-0.3
        denominator = minibatch_denominator(mask, trainer.config)
        loss = trainer.updater.micro_batch_loss(UpdateBatch(rollout, adv, ret, mask), denominator, MetricsAccumulator())
        losses[aggregation] = loss.item()
        ratio = math.exp(-0.3)  # below 1 - clip 0.2: the clipped branch reads 0.8
        per_token = torch.where(mask, torch.maximum(-adv * ratio, -adv * 0.8), 0.0)
        per_row = (per_token.sum(1), mask.sum(1))
    sums, counts = per_row
    assert (counts > 0).all() and len(set(counts.tolist())) > 1  # lengths differ: the aggregations disagree
    assert losses["token_mean"] == pytest.approx(sums.sum().item() / counts.sum().item(), abs=1e-5)
    assert losses["sequence_mean"] == pytest.approx((sums / counts).mean().item(), abs=1e-5)
    assert losses["fixed_length"] == pytest.approx(sums.sum().item() / (8 * 6), abs=1e-5)
    assert len({round(v, 6) for v in losses.values()}) == 3


def test_overlong_penalty_is_added_to_each_score_and_logged(tmp_path, tokenizer):
    """A constant reward of 1 with `reward.overlong_buffer` 3 of `rollout.max_new_tokens` 6, penalty 0.5: each
    response's score is 1 - 0.5 * max(L - 3, 0) / 3 (L its tokens), and `reward/overlong_penalty` is their mean."""
    trainer = make(
        tmp_path, tokenizer, lambda p, c: [1.0] * len(c), reward__overlong_buffer=3, reward__overlong_penalty=0.5
    )
    rollout, _ = first_batch(trainer)
    scored = trainer.score(rollout)
    lengths = rollout.response_mask.sum(1).float()
    expected = 1.0 - 0.5 * (lengths - 3).clamp(min=0) / 3
    assert (lengths > 3).any()  # some response is in the buffer
    assert torch.allclose(scored.token_scores.sum(1), expected)
    assert torch.allclose(scored.raw_scores, torch.ones(8))  # the sources' own scores, before the penalty
    history = trainer.train()
    assert history[0]["reward/overlong_penalty"] < 0
    assert history[0]["objective/scores"] == pytest.approx(1.0 + history[0]["reward/overlong_penalty"], abs=1e-5)


def test_zero_variance_groups_count_in_the_loss_denominator(tmp_path, tokenizer):
    """Pins what lmppo does with a group whose responses all scored alike (DAPO's zero-variance group): advantage 0,
    but its tokens stay in the token mean's denominator, so they dilute the step (as TRL's GRPOTrainer; DAPO's
    dynamic sampling instead fills the batch with groups that have a signal). First prompt: lengths as the score;
    every other prompt: a constant. Policy loss with every ratio e^-0.3 (below 1 - clip): max(-A e^-0.3, -A 0.8) per
    token, summed over the signal group's tokens, divided by ALL the batch's tokens."""
    from lmppo.training.metrics import MetricsAccumulator
    from lmppo.training.update import UpdateBatch, minibatch_denominator

    first = {}

    def reward(prompts, completions):
        first.setdefault("prompt", prompts[0])
        return [len(c) / 20.0 if p == first["prompt"] else 1.0 for p, c in zip(prompts, completions)]

    trainer = make(tmp_path, tokenizer, reward, **GRPO, ppo__vf_coef=0.0)
    rollout, rewards = first_batch(trainer)
    adv, ret = trainer.advantages(rollout, rewards)
    signal = rewards.signal.rows
    assert signal.tolist() == [True] * 4 + [False] * 4  # one group with a signal, one without
    assert rewards.train_mask[~signal].any()  # the silent group's tokens still train (KL / entropy terms)
    denominator = minibatch_denominator(rewards.train_mask, trainer.config)
    all_tokens, signal_tokens = rewards.train_mask.sum().item(), rewards.train_mask[signal].sum().item()
    assert denominator.item() == all_tokens > signal_tokens
    rollout.logprobs = rollout.logprobs + 0.3
    part = UpdateBatch(rollout, adv, ret, rewards.train_mask)
    loss = trainer.updater.micro_batch_loss(part, denominator, MetricsAccumulator())
    a = adv[signal][rewards.train_mask[signal]]  # the signal group's token advantages
    signal_sum = torch.maximum(-a * math.exp(-0.3), -a * 0.8).sum().item()
    assert signal_sum != 0
    assert loss.item() == pytest.approx(signal_sum / all_tokens, abs=1e-6)  # diluted: not signal_sum / signal_tokens
