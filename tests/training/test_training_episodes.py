"""PPO over multi-turn episodes on a tiny in-process model: the rollout's layout (policy turns, observation
tokens as context), the environment's per-turn rewards, the masks every phase uses, the episode metrics and the
sample table."""

from __future__ import annotations

import math
import os

import pytest
import torch

from conftest import TESTS, small_config, tiny_llama
from lmppo.core.advantages import ADVANTAGE_ESTIMATORS, gae
from lmppo.training.trainer import PPOTrainer

ROWS = [{"prompt": f"count down from {n}", "turns": n} for n in (1, 2, 3, 5)]


@pytest.fixture()
def env_path():
    return os.path.join(TESTS, "countdown_env.py") + ":Countdown"  # 0.25 per turn


def make_trainer(tmp_path, tokenizer, env_path, **fields):
    settings = dict(
        environment__path=env_path,
        environment__max_turns=3,
        environment__max_episode_tokens=80,
        rollout__stop_token="<|im_end|>",
        ppo__micro_batch_size=2,
    )
    cfg = small_config(tmp_path / "run", iterations=2, batch=4, **{**settings, **fields})
    cfg.reward.sources = []
    cfg.data.shuffle = False
    return PPOTrainer(cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=ROWS)


def test_an_episode_rollout_is_turns_with_observations_between(tmp_path, tokenizer, env_path):
    trainer = make_trainer(tmp_path, tokenizer, env_path)
    batch = trainer.collect_rollout()
    t, side = batch.episodes.turns, batch.episodes.side
    assert torch.equal(batch.action_mask, t.action_mask)
    turns = (t.turn_ends >= 0).sum(1).tolist()
    assert turns == [1, 2, 3, 3]  # the row with 5 turns is cut at max_turns = 3
    assert side.stop_reasons == ["environment", "environment", "environment", "max_turns"]
    assert batch.terminated.tolist() == [True, True, True, False] and batch.truncated.tolist() == [False] * 3 + [True]
    for b in range(4):
        real, policy = batch.response_mask[b], batch.action_mask[b]
        observation = real & ~policy
        text = tokenizer.decode(batch.response_ids[b][observation].tolist())
        assert text.count("<|im_start|>user\nturn ") == turns[b] - 1  # one observation between two turns
        assert (policy & ~real).sum() == 0
        last = int(real.nonzero().max())
        assert bool(policy[last])  # an episode ends on a policy token
        assert (batch.logprobs[b][~policy] == 0).all() and (batch.values[b][~policy] == 0).all()
    assert side.transcripts[1][1] == "turn 1 done, go on"
    # the opening is the environment's reset() through the chat template
    assert batch.prompts_shown[2] == "count down from 3"
    assert batch.episodes.prompts.texts[2].startswith("<|im_start|>user\ncount down from 3<|im_end|>")


def test_turn_rewards_kl_and_training_masks_follow_the_policy_tokens(tmp_path, tokenizer, env_path):
    trainer = make_trainer(tmp_path, tokenizer, env_path)
    batch = trainer.collect_rollout()
    scored = trainer.score(batch)
    assert scored.raw_scores.tolist() == [0.25, 0.5, 0.75, 0.75]
    ends = batch.episodes.turns.turn_ends
    for b in range(4):
        on = ends[b][ends[b] >= 0]
        assert scored.token_scores[b, on].tolist() == [0.25] * len(on)
    rewards = trainer.token_rewards(batch, scored)
    assert torch.equal(rewards.train_mask, batch.action_mask)
    assert (rewards.kl[~batch.action_mask] == 0).all()
    adv, ret = trainer.advantages(batch, rewards)
    assert (adv[~batch.action_mask] == 0).all() and (ret[~batch.action_mask] == 0).all()


def test_turn_gae_gives_the_trainer_one_advantage_per_turn(tmp_path, tokenizer, env_path):
    """`ppo.advantage_estimator: turn_gae` reaches the trainer's advantages: on the multi-turn rows each turn's
    tokens share one advantage (token-level `gae` on the same batch does not), and they are `turn_gae`'s."""
    trainer = make_trainer(
        tmp_path, tokenizer, env_path, ppo__advantage_estimator="turn_gae", ppo__whiten_advantages=False
    )
    batch = trainer.collect_rollout()
    rewards = trainer.token_rewards(batch, trainer.score(batch))
    adv, ret = trainer.advantages(batch, rewards)
    p, mask = trainer.config.ppo, batch.action_mask
    expected = ADVANTAGE_ESTIMATORS["turn_gae"](rewards.rewards, batch.values, mask, gamma=p.gamma, lam=p.lam)
    torch.testing.assert_close((adv, ret), expected)
    token_level, _ = gae(rewards.rewards, batch.values, mask, gamma=p.gamma, lam=p.lam)
    ends = batch.episodes.turns.turn_ends
    for b in range(1, 4):  # rows with 2 and 3 turns
        turn_ends = ends[b][ends[b] >= 0].tolist()
        starts = [int(mask[b].nonzero()[0])] + [int(mask[b, e + 1 :].nonzero()[0]) + e + 1 for e in turn_ends[:-1]]
        for start, end in zip(starts, turn_ends):
            assert mask[b, start : end + 1].all() and (adv[b, start : end + 1] == adv[b, start]).all()
        assert len(set(adv[b, starts].tolist())) == len(starts)  # one advantage per turn, not one per episode
        assert not torch.allclose(adv[b][mask[b]], token_level[b][mask[b]])


def test_training_on_episodes_logs_the_episode_metrics_and_whole_episodes(tmp_path, tokenizer, env_path):
    trainer = make_trainer(tmp_path, tokenizer, env_path, log__sample_every=1, log__num_samples=2)
    history = trainer.train()
    assert len(history) == 2
    last = history[-1]
    assert last["episode/turns"] == pytest.approx(9 / 4)
    assert last["episode/ended_by_environment"] == 0.75 and last["episode/ended_by_max_turns"] == 0.25
    assert last["episode/reward_per_turn"] == pytest.approx(0.25)
    assert 0 < last["episode/policy_token_frac"] < 1
    assert all(math.isfinite(v) for v in last.values())
    samples = (tmp_path / "run" / "samples.jsonl").read_text()
    assert "[1] " in samples and "[2] " in samples and "> turn 1 done, go on" in samples


def test_the_native_engine_and_the_hf_engine_play_the_same_episode_layout(tmp_path, tokenizer, env_path):
    """`hf` samples each turn from the whole history (RepeatedPrefill): different draws, same episode structure."""
    trainer = make_trainer(tmp_path, tokenizer, env_path, rollout__backend="hf")
    batch = trainer.collect_rollout()
    assert (batch.episodes.turns.turn_ends >= 0).sum(1).tolist() == [1, 2, 3, 3]


def test_the_episode_token_budget_truncates(tmp_path, tokenizer, env_path):
    """max_episode_tokens 30: after two 6-token turns and a ~15-token observation no second observation fits."""
    trainer = make_trainer(tmp_path, tokenizer, env_path, environment__max_episode_tokens=30)
    batch = trainer.collect_rollout()
    assert batch.response_mask.sum(1).max() <= 30
    assert batch.episodes.side.stop_reasons[0] == "environment"  # one turn: always fits
    assert batch.episodes.side.stop_reasons[2:] == ["max_episode_tokens", "max_episode_tokens"]
    assert batch.truncated.tolist() == [r != "environment" for r in batch.episodes.side.stop_reasons]


def test_heldout_evaluation_plays_episodes(tmp_path, tokenizer, env_path):
    """eval/* during training and the end-of-run summary play one episode per held-out prompt: the environment's
    total reward is `reward/environment` (0.25 per turn here), the responses are the transcripts."""
    from lmppo.evaluation.summary import heldout_summary
    from lmppo.training.report import run_record

    rows = ROWS + [{"prompt": f"count down from {n}", "turns": n} for n in (2, 2, 1, 1)]
    settings = dict(
        environment__path=env_path, environment__max_turns=3, rollout__stop_token="<|im_end|>", ppo__micro_batch_size=2
    )
    cfg = small_config(tmp_path / "run", iterations=1, batch=4, data__holdout=2, log__eval_every=1, **settings)
    cfg.reward.sources = []
    trainer = PPOTrainer(cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=rows)
    held_turns = [min(int(c["turns"]), 3) for c in trainer.holdout_set.columns]
    history = trainer.train()
    assert history[-1]["eval/reward/environment"] == pytest.approx(0.25 * sum(held_turns) / 2)
    summary = heldout_summary(run_record(trainer), num_samples=1, samples_per_prompt=1)
    assert summary["before"]["reward/environment"] == pytest.approx(0.25 * sum(held_turns) / 2)
    assert summary["after"]["reward/environment"] == pytest.approx(0.25 * sum(held_turns) / 2)
    assert summary["samples"][0]["after"].startswith("[1] ")


def test_span_rewards_land_inside_the_last_turn(tmp_path, tokenizer, env_path):
    """A reward source's span on the first character of the completion (the last turn's text) is placed on that
    turn's first token, wherever the turn sits in the episode; the environment's rewards stay on each turn's end."""
    from lmppo.core.rewards import place_turn_rewards

    def first_character(completions, **kwargs):
        return [[(0, 1, 1.0)] if c else 0.0 for c in completions]

    cfg = small_config(
        tmp_path / "run",
        iterations=1,
        batch=4,
        environment__path=env_path,
        environment__max_turns=3,
        environment__max_episode_tokens=80,
        rollout__stop_token="<|im_end|>",
        ppo__micro_batch_size=2,
    )
    cfg.reward.sources = []
    cfg.data.shuffle = False
    trainer = PPOTrainer(
        cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=ROWS, reward_functions=[first_character]
    )
    batch = trainer.collect_rollout()
    scored = trainer.score(batch)
    environment = place_turn_rewards(
        batch.episodes.turns.turn_ends, batch.episodes.turns.turn_rewards, batch.response_ids.shape[1]
    )
    from_source = scored.token_scores - environment
    checked = 0
    for b in range(4):
        if not batch.episodes.side.texts[b]:
            continue
        checked += 1
        nonzero = from_source[b].nonzero().flatten().tolist()
        assert len(nonzero) == 1 and from_source[b, nonzero[0]] == 1.0
        position = nonzero[0]
        assert bool(batch.action_mask[b, position])
        # it is the first token of the last turn: everything from it to the episode's end is that turn
        last_end = int(batch.episodes.turns.turn_ends[b].max())
        assert bool(batch.action_mask[b, position : last_end + 1].all())
        assert position == 0 or not bool(batch.action_mask[b, position - 1])
    assert checked >= 2


def test_reward_truncation_applies_to_truncated_episodes(tmp_path, tokenizer, env_path):
    """`reward.truncation: penalty` (replace, -1): the episode cut by max_turns scores exactly -1, on its last policy
    token; the episodes the environment ended keep their turn rewards."""
    trainer = make_trainer(tmp_path, tokenizer, env_path, reward__truncation="penalty", reward__penalty=-1.0)
    batch = trainer.collect_rollout()
    scored = trainer.score(batch)
    assert batch.truncated.tolist() == [False, False, False, True]
    assert scored.token_scores.sum(1).tolist() == [0.25, 0.5, 0.75, -1.0]
    last = int(batch.episodes.turns.turn_ends[3].max())
    assert scored.token_scores[3, last] == -1.0 and (scored.token_scores[3, :last] == 0).all()


def test_an_environment_failing_mid_run_leaves_the_run_resumable(tmp_path, tokenizer):
    """The environment raises in iteration 2 (after 4 episodes of iteration 1): one error line naming it, the row and
    the turn; the run folder keeps iteration 1's checkpoint, which verifies, and the run resumes from it."""
    from lmppo.environments.api import EnvironmentError
    from lmppo.run.manifest import latest_checkpoint, verify_checkpoint

    env = os.path.join(TESTS, "countdown_env.py") + ":BreaksLater"
    trainer = make_trainer(tmp_path, tokenizer, env, checkpoint__every=1)
    breaks = trainer.road().producer.player.factory  # the class as loaded from its file
    breaks.built, breaks.BREAK_AT = 0, 4
    with pytest.raises(EnvironmentError) as info:
        trainer.train()
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(f"environment `{env}`, prompt row ")
    assert "turn 1: step() raised RuntimeError: the environment's server went away" in str(info.value)
    assert trainer.iteration == 1
    out = str(tmp_path / "run")
    checkpoint = latest_checkpoint(out)
    assert checkpoint is not None and verify_checkpoint(checkpoint)
    breaks.BREAK_AT = 10**9
    resumed = PPOTrainer.resume(out, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=ROWS)
    resumed.road().producer.player.factory.BREAK_AT = 10**9
    assert resumed.iteration == 1
    assert len(resumed.train()) == 1  # iteration 2, the one that failed
