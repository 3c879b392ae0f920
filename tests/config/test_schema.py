"""The config through the Python API, YAML and the command line: values converted to the field's type and kept,
or refused at once with one ConfigError naming the field; choices as Literal types, listed in --help."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from lmppo.apps.cli import main
from lmppo.config import (
    Config,
    KLConfig,
    RewardSourceConfig,
    apply_override,
    from_dict,
    load_config,
    parse_overrides,
)
from lmppo.errors import ConfigError
from lmppo.registry import KL_CONTROLLERS


def test_assignments_are_converted_and_kept():
    cfg = Config()
    cfg.data.shuffle = "false"  # a truthy string that would shuffle: becomes False
    assert cfg.data.shuffle is False
    cfg.ppo.num_epochs = "2"
    assert cfg.ppo.num_epochs == 2 and type(cfg.ppo.num_epochs) is int
    cfg.ppo.learning_rate = "3e-6"
    assert cfg.ppo.learning_rate == 3e-6
    cfg.rollout.stop_token = 7  # a number where text is wanted: its text
    assert cfg.rollout.stop_token == "7"
    cfg.reward.sources = [{"kind": "function", "path": "m:f", "weight": "0.5"}]  # a mapping becomes a section
    assert isinstance(cfg.reward.sources[0], RewardSourceConfig) and cfg.reward.sources[0].weight == 0.5


@pytest.mark.parametrize(
    "statement, field, value, says",
    [
        ("cfg.ppo.num_epochs = 'two'", "ppo.num_epochs", "'two'", "must be an integer"),
        ("cfg.rollout.batch_size = 2.5", "rollout.batch_size", "2.5", "must be an integer"),
        ("cfg.data.shuffle = 'maybe'", "data.shuffle", "'maybe'", "must be true or false"),
        ("cfg.log.trackers = 'tensorboard'", "log.trackers", "'tensorboard'", "must be a list, e.g. ['tensorboard']"),
        ("cfg.log.trackers = ['mlfow']", "log.trackers[0]", "'mlfow'", "did you mean `mlflow`"),
        ("cfg.precision = 'fp16'", "precision", "'fp16'", "must be one of `auto`, `fp32`, `bf16`"),
        ("cfg.kl.coef = float('nan')", "kl.coef", "nan", "must be a finite number"),
        ("cfg.data.shufle = False", "data.shufle", "False", "is not a known field (did you mean `data.shuffle`?)"),
        ("cfg.ppo = 5", "ppo", "5", "must be a mapping of PPOConfig fields"),
        (
            "cfg.reward.sources = [{'kind': 'http', 'path': 'http://h', 'timeout': 'x'}]",
            "reward.sources[0].timeout",
            "'x'",
            "must be a number",
        ),
        (
            "RewardSourceConfig(span_placement='first')",
            "reward.sources[*].span_placement",
            "'first'",
            "must be one of `last`, `spread`",
        ),
        ("dataclasses.replace(cfg.kl, controller='pid')", "kl.controller", "'pid'", "did you mean `pi`"),
        ("cfg.ppo.num_epochs = 0", "ppo.num_epochs", "0", "must be > 0"),
        ("cfg.ppo.gamma = 1.5", "ppo.gamma", "1.5", "must be <= 1"),
        ("cfg.log.eval_every = -1", "log.eval_every", "-1", "must be >= 0"),
        ("cfg.seed = 2 ** 32", "seed", "4294967296", "must be <= 4294967295"),
    ],
)
def test_wrong_values_are_one_config_error_at_once(statement, field, value, says):
    cfg = Config()
    with pytest.raises(ConfigError) as info:
        exec(statement, {"cfg": cfg, "RewardSourceConfig": RewardSourceConfig, "dataclasses": dataclasses})
    assert str(info.value) == f"config field `{field}` = {value}: " + str(info.value).split(": ", 1)[1]
    assert says in str(info.value) and "\n" not in str(info.value)


def test_changes_in_place_are_checked_by_validate(tmp_path):
    cfg = Config()
    cfg.log.trackers.append("bogus")
    with pytest.raises(ConfigError, match=r"`log.trackers\[1\]` = 'bogus': must be one of"):
        cfg.validate()
    cfg = Config()
    cfg.log.trackers = []
    cfg.reward.sources.append({"kind": "function", "path": "lmppo.rewards.builtin:vader_sentiment", "name": "v2"})
    cfg.validate()
    assert isinstance(cfg.reward.sources[1], RewardSourceConfig) and cfg.reward.sources[1].name == "v2"


def test_loading_names_the_first_bad_field(tmp_path):
    with pytest.raises(ConfigError, match=r"`reward.sources\[1\].timeout` = 'soon': must be a number"):
        from_dict(
            Config,
            {
                "reward": {
                    "sources": [
                        {"kind": "http", "path": "http://h"},
                        {"kind": "http", "path": "http://h", "timeout": "soon"},
                    ]
                }
            },
        )
    with pytest.raises(ConfigError, match=r"`reward.sources\[0\]` = 3: must be a mapping of RewardSourceConfig"):
        from_dict(Config, {"reward": {"sources": [3]}})
    (tmp_path / "c.yaml").write_text("ppo:\n  # num_epochs: 2\nseed: '3'\n")  # a section with nothing under it
    cfg = load_config(str(tmp_path / "c.yaml"))
    assert cfg.ppo == Config().ppo and cfg.seed == 3


def test_command_line_lists_and_mappings():
    cfg = load_config(
        None,
        parse_overrides(
            [
                "--log.trackers",
                "wandb,mlflow",
                "--rollout.generation_kwargs",
                "{top_k: 3}",
                "--data.shuffle=no",
                "--kl.coef",
                "1e-3",
            ]
        ),
    )
    assert cfg.log.trackers == ["wandb", "mlflow"] and cfg.rollout.generation_kwargs == {"top_k": 3}
    assert cfg.data.shuffle is False and cfg.kl.coef == 1e-3
    apply_override(cfg, "log.trackers", "[tensorboard]")
    assert cfg.log.trackers == ["tensorboard"]
    with pytest.raises(ConfigError, match=r"`log.trackers\[0\]` = 'tensorbord': .*did you mean `tensorboard`"):
        apply_override(cfg, "log.trackers", "tensorbord")


def test_choices_are_literals_or_registry_names_listed_in_help(capsys):
    assert typing.get_origin(typing.get_type_hints(KLConfig)["placement"]) is typing.Literal
    with pytest.raises(ConfigError, match=r"`kl.controller` = 'pid': must be one of `pi`, `adaptive`, `fixed`"):
        KLConfig(controller="pid")  # a registry's names, checked on construction like a Literal
    assert KL_CONTROLLERS.names() == ("pi", "adaptive", "fixed")
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--precision {auto,fp32,bf16}" in out and "--reward.truncation {none,penalty,bootstrap,drop}" in out
    assert (
        "--log.trackers LIST[{tensorboard,wandb,trackio," in out and "--data.long_prompts {truncate_left,error}" in out
    )
    assert "Passes of PPO updates over each rollout batch. Allowed: > 0." in out  # ppo.num_epochs
    assert "GAE lambda. Allowed: >= 0, <= 1." in out
