"""Sizes and choices the assembly derives from a config (lmppo.training.assembly); building whole components is
exercised by every training test."""

import pytest

from lmppo.config import Config, RewardSourceConfig
from lmppo.errors import ConfigError
from lmppo.training.assembly import check_process_split, critic_init_path, prompts_per_iteration


def _cfg(**rollout) -> Config:
    cfg = Config()
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return cfg


def test_prompts_per_iteration_counts_prompts_not_episodes():
    assert prompts_per_iteration(_cfg(batch_size=32, num_samples_per_prompt=4)) == 8


def test_the_processes_must_split_prompts_and_minibatches_evenly():
    cfg = _cfg(batch_size=16, num_samples_per_prompt=1)
    cfg.ppo.num_minibatches, cfg.ppo.micro_batch_size = 1, 4  # one minibatch of 16
    check_process_split(cfg, 2)  # 8 prompts and 8 of the minibatch each: two micro-batches of 4
    with pytest.raises(ConfigError, match=r"rollout.batch_size.*with 5 processes, the prompts per iteration \(16\)"):
        check_process_split(cfg, 5)
    with pytest.raises(ConfigError, match=r"ppo.micro_batch_size.*share of a minibatch \(16 / 8 processes\)"):
        check_process_split(cfg, 8)  # 2 each: not a multiple of 4


def test_the_critic_starts_from_the_policy_without_a_reward_model():
    cfg = Config()
    cfg.reward.sources = [RewardSourceConfig(kind="function", path="lmppo.rewards.builtin:vader_sentiment")]
    cfg.value.init_from = "auto"
    assert critic_init_path(cfg) is None
    cfg.value.init_from = "policy"
    assert critic_init_path(cfg) is None
