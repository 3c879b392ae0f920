"""A tiny in-process model trained for one iteration on each: a TextArena game (`textarena:GuessTheNumber-v0` over
`builtin:textarena` rows) and a reasoning-gym task (`reasoning_gym:basic_arithmetic` scored by `reasoning_gym`):
the whole road runs, the game's reward at close and the task's score reach the metrics."""

from __future__ import annotations

import pytest

from conftest import small_config, tiny_llama
from lmppo.config import RewardSourceConfig
from lmppo.training.trainer import PPOTrainer

pytest.importorskip("textarena")
pytest.importorskip("reasoning_gym")


def test_a_textarena_game_trains_with_its_reward_at_close(tmp_path, tokenizer):
    cfg = small_config(
        tmp_path / "run",
        iterations=1,
        batch=4,
        ppo__micro_batch_size=2,
        environment__path="textarena:GuessTheNumber-v0",
        environment__max_turns=2,
        environment__max_episode_tokens=200,
        environment__max_observation_tokens=200,
        data__prompts="builtin:textarena",
        rollout__stop_token="<|im_end|>",
        rollout__num_samples_per_prompt=2,
    )
    cfg.reward.sources = []
    policy = tiny_llama(tokenizer)
    policy.config.max_position_embeddings = 1024  # the game's opening is long in the tiny tokenizer's pieces (RoPE)
    (metrics,) = PPOTrainer(cfg, policy=policy, tokenizer=tokenizer).train()
    assert metrics["episode/turns"] >= 1.0
    # the tiny model writes no `[number]`: two invalid moves end a game with TextArena's reward for it (0), or the
    # turns run out; either way 0 in [0, 1]
    assert 0.0 <= metrics["objective/scores"] <= 1.0


def test_a_reasoning_gym_task_trains_on_its_own_score(tmp_path, tokenizer):
    cfg = small_config(
        tmp_path / "run",
        iterations=1,
        batch=4,
        ppo__micro_batch_size=2,
        data__prompts="reasoning_gym:basic_arithmetic",
        data__task_options={"max_terms": 2, "max_digits": 1},
        data__holdout=2,
    )
    cfg.reward.sources = [RewardSourceConfig(kind="function", path="lmppo.rewards.builtin:reasoning_gym")]
    (metrics,) = PPOTrainer(cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer).train()
    assert "reward/reasoning_gym" in metrics and 0.0 <= metrics["reward/reasoning_gym"] <= 1.0
