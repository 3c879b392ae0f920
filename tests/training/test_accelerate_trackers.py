"""Trackers through accelerate's tracker API: every tracker accelerate supports can be named in `log.trackers`.

The trackers' packages (mlflow, aim, ...) are not installed here, so a stand-in of accelerate's `GeneralTracker`
takes mlflow's place in `accelerate.tracking.LOGGER_TYPE_TO_CLASS` and records what lmppo calls on it."""

from __future__ import annotations

import json
import os

import pytest
from accelerate import tracking

from conftest import tiny_llama
from lmppo.config import Config
from lmppo.errors import ConfigError, LmppoError
from lmppo.training.metrics import ACCELERATE_TRACKERS, TRACKERS, make_trackers
from lmppo.training.trainer import PPOTrainer


def test_every_tracker_accelerate_supports_can_be_chosen():
    assert set(tracking.LOGGER_TYPE_TO_CLASS) <= set(TRACKERS)
    assert set(ACCELERATE_TRACKERS) | {"tensorboard", "wandb", "trackio"} == set(TRACKERS)


def test_an_unknown_tracker_is_a_one_line_config_error():
    cfg = Config()
    with pytest.raises(ConfigError, match=r"log.trackers.*'mlfow'.*did you mean `mlflow`"):
        cfg.log.trackers = ["mlfow"]  # refused on assignment


@pytest.mark.skipif(tracking.is_mlflow_available(), reason="checks the message when the package is missing")
def test_a_missing_package_is_a_one_line_error(tmp_path):
    with pytest.raises(LmppoError) as err:
        make_trackers(["mlflow"], str(tmp_path), {}, "run")
    assert "`mlflow`" in str(err.value) and "package is missing" in str(err.value) and "\n" not in str(err.value)


class StandIn(tracking.GeneralTracker):
    """Records the calls accelerate's tracker interface receives."""

    name = "mlflow"
    requires_logging_directory = False
    calls: list = []

    def __init__(self, run_name, **kwargs):
        super().__init__()
        StandIn.calls.append(("init", run_name))

    @property
    def tracker(self):
        return self

    def start(self):
        StandIn.calls.append(("start",))

    def store_init_configuration(self, values):
        StandIn.calls.append(("config", values))

    def log(self, values, step=None, **kwargs):
        StandIn.calls.append(("log", step, values))

    def finish(self):
        StandIn.calls.append(("finish",))


def test_a_run_logs_to_an_accelerate_tracker(tokenizer, tmp_path, monkeypatch):
    StandIn.calls = []
    monkeypatch.setitem(tracking.LOGGER_TYPE_TO_CLASS, "mlflow", StandIn)
    monkeypatch.setattr(tracking, "is_mlflow_available", lambda: True)
    cfg = Config()
    cfg.precision, cfg.output_dir, cfg.log.trackers = "fp32", str(tmp_path / "my_run"), ["mlflow"]
    cfg.rollout.batch_size, cfg.rollout.max_new_tokens = 4, 3
    cfg.ppo.num_epochs, cfg.ppo.micro_batch_size, cfg.total_episodes = 1, 4, 8
    history = PPOTrainer(
        cfg,
        policy=tiny_llama(tokenizer),
        tokenizer=tokenizer,
        prompts=["a b", "c d", "e f"],
        reward_functions=[lambda p, c: [0.5] * len(c)],
    ).train()
    kinds = [c[0] for c in StandIn.calls]
    assert kinds == ["init", "start", "config", "log", "log", "finish"]
    assert StandIn.calls[0] == ("init", "my_run")
    config = StandIn.calls[2][1]
    assert config["ppo.micro_batch_size"] == 4 and config["log.trackers"] == "['mlflow']"
    logs = [c for c in StandIn.calls if c[0] == "log"]
    assert [step for _, step, _ in logs] == [4, 8]
    assert logs[1][2]["objective/scores"] == pytest.approx(history[1]["objective/scores"])
    written = [json.loads(x) for x in open(os.path.join(cfg.output_dir, "metrics.jsonl"))]
    assert len(written) == 2  # metrics.jsonl stays the record
