"""`environment.on_error: drop` in training: the failed episode stays in the batch's tensors, invalid (no score, no
policy or value gradient), counted in `episode/dropped`; the other episodes train as without it."""

from __future__ import annotations

import os
import warnings

import pytest

from conftest import TESTS, small_config, tiny_llama
from lmppo.training.trainer import PPOTrainer

# Countdown rows: 0.25 per turn; row 1 fails at its 2nd turn, after one turn rewarded 0.25
ROWS = [
    {"prompt": "count down from 1", "turns": 1},
    {"prompt": "count down from 2", "turns": 2, "fail_at": 2},
    {"prompt": "count down from 3", "turns": 3},
    {"prompt": "count down from 2", "turns": 2},
]


def make_trainer(tmp_path, tokenizer, **fields):
    cfg = small_config(
        tmp_path / "run",
        iterations=1,
        batch=4,
        environment__path=os.path.join(TESTS, "countdown_env.py") + ":FailsOnSome",
        environment__max_turns=3,
        environment__max_episode_tokens=80,
        rollout__stop_token="<|im_end|>",
        ppo__micro_batch_size=2,
        **fields,
    )
    cfg.reward.sources = []
    cfg.data.shuffle = False
    return PPOTrainer(cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=ROWS)


def test_a_dropped_episode_is_kept_in_the_batch_and_trained_on_by_nothing(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, environment__on_error="drop")
    with pytest.warns(UserWarning, match=r"dropped 1 of 4 episodes .* prompt row 1, turn 2: step\(\) raised"):
        batch = trainer.collect_rollout()
    assert batch.stop_reasons == ["environment", "dropped", "environment", "environment"]
    assert (batch.turn_ends[1] >= 0).sum() == 2  # its failed turn was sampled, and stays in the tensors
    scored = trainer.score(batch)
    assert scored.valid.tolist() == [True, False, True, True]
    assert scored.token_scores.sum(1).tolist() == [0.25, 0.0, 0.75, 0.5]  # its first turn's 0.25 is not kept
    rewards = trainer.token_rewards(batch, scored)
    assert not rewards.train_mask[1].any() and rewards.train_mask[0].any()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (metrics,) = trainer.train()
    assert metrics["episode/dropped"] == 0.25 and metrics["reward/num_invalid"] == 1


def test_stop_is_the_default(tmp_path, tokenizer):
    from lmppo.environments.api import EnvironmentError

    trainer = make_trainer(tmp_path, tokenizer)
    with pytest.raises(EnvironmentError, match=r"prompt row 1, turn 2: step\(\) raised RuntimeError: failed at turn 2"):
        trainer.collect_rollout()
