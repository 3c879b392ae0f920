"""lmppo.config.reward_model: `lmppo reward-model`'s config is `lmppo train`'s machinery, spelled as `lmppo train`."""

from __future__ import annotations

import pytest

from lmppo.config import Config, RewardModelConfig, all_fields, load_root, parse_overrides
from lmppo.errors import ConfigError

SHARED = (
    "output_dir",
    "seed",
    "precision",
    "device",
    "overwrite",
    "model.policy",
    "model.lora.enabled",
    "model.lora.r",
    "model.lora.alpha",
    "data.holdout",
    "log.trackers",
    "checkpoint.every",
    "checkpoint.keep_last",
)
"""The options both commands have: one spelling."""


def test_the_shared_options_are_spelled_as_lmppo_train_spells_them():
    ppo = {name for name, *_ in all_fields(Config)}
    ours = {name for name, *_ in all_fields(RewardModelConfig)}
    assert set(SHARED) <= ppo & ours
    assert ours - ppo == {"data.pairs", "data.max_length", *(f"training.{f}" for f in (
        "epochs", "learning_rate", "batch_size", "center_rewards_coefficient"))}  # fmt: skip


def test_a_yaml_file_then_dotted_overrides(tmp_path):
    path = tmp_path / "rm.yaml"
    path.write_text("seed: 4\ntraining:\n  epochs: 5\n  center_rewards_coefficient: 0.01\nlog:\n  trackers: []\n")
    overrides = parse_overrides(["--training.epochs", "3", "--model.lora.r=8"], RewardModelConfig, "lmppo reward-model")
    cfg = load_root(RewardModelConfig, str(path), overrides)
    assert (cfg.seed, cfg.training.epochs, cfg.training.center_rewards_coefficient) == (4, 3, 0.01)
    assert cfg.model.lora.r == 8 and cfg.log.trackers == [] and cfg.model.lora.enabled  # LoRA by default


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"training.learning_rate": "1"}, "`training.learning_rate` = '1': must be < 1"),
        (
            {"training.center_rewards_coefficient": "-0.1"},
            "`training.center_rewards_coefficient` = '-0.1': must be >= 0",
        ),
        ({"data.holdout": "0"}, "`data.holdout` = '0': must be > 0"),
        ({"log.trackers": "[tensorbord]"}, r"`log.trackers\[0\]` = 'tensorbord': .*did you mean `tensorboard`"),
        ({"device": "tpu"}, "`device` = 'tpu': must be one of `auto`, `cpu`, `cuda`"),
    ],
)
def test_a_bad_value_is_one_error_naming_the_dotted_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_root(RewardModelConfig, None, overrides)


def test_an_unknown_option_names_the_command_and_the_closest_one(tmp_path):
    with pytest.raises(
        ConfigError, match=r"`--training.epoch` \(did you mean `--training.epochs`\?\); see `lmppo rewa"
    ):
        parse_overrides(["--training.epoch", "2"], RewardModelConfig, "lmppo reward-model")
    with pytest.raises(ConfigError, match="unknown option `--ppo.num_epochs`; see `lmppo reward-model --help`"):
        parse_overrides(["--ppo.num_epochs", "2"], RewardModelConfig, "lmppo reward-model")  # PPO's, not ours
    path = tmp_path / "rm.yaml"
    path.write_text("training:\n  epoch: 2\n")
    with pytest.raises(ConfigError, match=r"`training.epoch` = .*did you mean `training.epochs`"):
        load_root(RewardModelConfig, str(path))
