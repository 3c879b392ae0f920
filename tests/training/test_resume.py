"""Exact resume: an interrupted run continued from its checkpoint ends bit for bit where an uninterrupted run
ends (weights, optimizer, metrics, samples), and a resume that would mean something else is refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml

from lmppo.apps.cli import main
from lmppo.errors import CheckpointError, ConfigError
from lmppo.run.folder import list_checkpoints
from lmppo.training.trainer import PPOTrainer
from train_worker import api_objects, comparable, length_reward, make_config, read_jsonl


def interrupt_in_iteration(n: int):
    """A length reward that raises KeyboardInterrupt (a Ctrl-C, or a kill) during iteration `n`."""
    calls = {"n": 0}

    def reward(prompts, completions):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return length_reward(prompts, completions)

    return reward


def assert_same_state(a: PPOTrainer, b: PPOTrainer) -> None:
    for (name, p), (_, q) in zip(a.actor.named_parameters(), b.actor.named_parameters()):
        assert torch.equal(p, q), name
    if a.critic is not None:
        for (name, p), (_, q) in zip(a.critic.named_parameters(), b.critic.named_parameters()):
            assert torch.equal(p, q), "critic " + name
    if a.reference.model is not None:
        for (name, p), (_, q) in zip(a.reference.model.named_parameters(), b.reference.model.named_parameters()):
            assert torch.equal(p, q), "reference " + name
    sa, sb = a.updater.optimizer.state_dict(), b.updater.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        for key in sa["state"][i]:
            assert torch.equal(sa["state"][i][key], sb["state"][i][key]), (i, key)
    assert a.kl_controller.coef == b.kl_controller.coef
    assert a.score_moments.state_dict() == b.score_moments.state_dict()
    assert a.stream.state_dict() == b.stream.state_dict()
    assert a.updater.scheduler.get_last_lr() == b.updater.scheduler.get_last_lr()
    assert (a.iteration, a.episode) == (b.iteration, b.episode)


def assert_same_logs(dir_a: str, dir_b: str) -> None:
    ma, mb = read_jsonl(os.path.join(dir_a, "metrics.jsonl")), read_jsonl(os.path.join(dir_b, "metrics.jsonl"))
    assert [m["iteration"] for m in mb] == list(range(1, len(ma) + 1))
    assert [comparable(m) for m in ma] == [comparable(m) for m in mb]
    if os.path.exists(os.path.join(dir_a, "samples.jsonl")):
        assert read_jsonl(os.path.join(dir_a, "samples.jsonl")) == read_jsonl(os.path.join(dir_b, "samples.jsonl"))


SETTINGS = {
    # shared value head, adaptive KL, score normalisation, EMA reference moving every iteration, warm-up + decay
    "shared": dict(
        value__mode="shared",
        reward__normalize=True,
        reference__mode="ema",
        reference__every=1,
        ppo__warmup_iterations=1,
        ppo__lr_schedule="linear",
    ),
    # separate critic, adaptive KL, truncation penalty, reference synced every 2 iterations, cosine schedule
    "critic": dict(
        value__mode="critic",
        reward__truncation="penalty",
        reference__mode="sync",
        reference__every=2,
        ppo__lr_schedule="cosine",
    ),
}


@pytest.mark.parametrize("value_mode", ["shared", "critic"])
def test_interrupted_and_resumed_run_equals_uninterrupted_run(tmp_path, tokenizer, value_mode):
    fields = dict(SETTINGS[value_mode], checkpoint__every=2, log__sample_every=1)
    straight = PPOTrainer(make_config(str(tmp_path / "straight"), 4, **fields), **api_objects(tokenizer))
    straight.train()

    run = str(tmp_path / "run")
    first = PPOTrainer(make_config(run, 4, **fields), **api_objects(tokenizer, interrupt_in_iteration(4)))
    with pytest.raises(KeyboardInterrupt):
        first.train()  # iterations 1-3 logged, checkpoint after 2, stopped inside iteration 4
    assert len(read_jsonl(os.path.join(run, "metrics.jsonl"))) == 3

    resumed = PPOTrainer.resume(run, **api_objects(tokenizer))
    assert (resumed.iteration, resumed.episode) == (2, 16)
    assert [m["iteration"] for m in read_jsonl(os.path.join(run, "metrics.jsonl"))] == [1, 2]  # 3 is redone
    history = resumed.train()
    assert [m["iteration"] for m in history] == [3, 4]
    assert_same_state(straight, resumed)
    assert_same_logs(str(tmp_path / "straight"), run)


def test_lora_run_resumes_exactly(tmp_path, tokenizer):
    fields = dict(model__lora__enabled=True, model__lora__r=4, checkpoint__every=1)
    straight = PPOTrainer(make_config(str(tmp_path / "straight"), 3, **fields), **api_objects(tokenizer))
    straight.train()
    run = str(tmp_path / "run")
    first = PPOTrainer(make_config(run, 3, **fields), **api_objects(tokenizer, interrupt_in_iteration(3)))
    with pytest.raises(KeyboardInterrupt):
        first.train()
    # only the adapters and the value head are stored: the base weights come from model.policy again
    names = json.load(open(os.path.join(run, "checkpoints", "iter-00000002", "manifest.json")))["files"]
    assert "trained.safetensors" in names
    from safetensors.torch import load_file

    stored = load_file(os.path.join(run, "checkpoints", "iter-00000002", "trained.safetensors"))
    assert stored and all("lora_" in k or "value_head" in k for k in stored)
    resumed = PPOTrainer.resume(run, **api_objects(tokenizer))
    resumed.train()
    assert_same_state(straight, resumed)
    assert_same_logs(str(tmp_path / "straight"), run)


def test_finished_run_is_extended_by_a_larger_total_episodes(tmp_path, tokenizer):
    fields = dict(ppo__lr_schedule="constant")  # checkpoint.every 0: one checkpoint, after the last iteration
    straight = PPOTrainer(make_config(str(tmp_path / "straight"), 4, **fields), **api_objects(tokenizer))
    straight.train()
    run = str(tmp_path / "run")
    PPOTrainer(make_config(run, 2, **fields), **api_objects(tokenizer)).train()
    assert [i for i, _ in list_checkpoints(run)] == [2]
    assert os.path.isdir(os.path.join(run, "final", "policy"))

    again = PPOTrainer.resume(run, **api_objects(tokenizer))  # same total: nothing left to do
    assert again.train() == [] and again.iteration == 2

    resumed = PPOTrainer.resume(run, overrides={"total_episodes": 32}, **api_objects(tokenizer))
    resumed.train()
    assert_same_state(straight, resumed)
    assert_same_logs(str(tmp_path / "straight"), run)
    with open(os.path.join(run, "config.yaml")) as fh:
        assert yaml.safe_load(fh)["total_episodes"] == 32
    assert [i for i, _ in list_checkpoints(run)] == [4, 2]


# ----------------------------------------------------------------------------- through the command line


@pytest.fixture()
def cli_run(tmp_path, tiny_model_dir):
    """A config file for `lmppo train` with the tiny model, a prompt file and a reward in a .py file that
    raises KeyboardInterrupt on call $LMPPO_TEST_INTERRUPT_AT."""
    (tmp_path / "prompts.txt").write_text(
        "\n".join(
            ["the movie was", "this film is", "my friend felt", "the story seemed", "a critic said", "we left early"]
        )
    )
    (tmp_path / "reward.py").write_text(
        "import os\nCALLS = [0]\n\n"
        "def length(prompts, completions):\n"
        "    CALLS[0] += 1\n"
        "    if str(CALLS[0]) == os.environ.get('LMPPO_TEST_INTERRUPT_AT'):\n"
        "        raise KeyboardInterrupt\n"
        "    return [len(c) / 20.0 for c in completions]\n"
    )
    config = {
        "output_dir": str(tmp_path / "run"),
        "total_episodes": 24,
        "model": {"policy": tiny_model_dir},
        "data": {"prompts": str(tmp_path / "prompts.txt")},
        "rollout": {"batch_size": 8, "max_new_tokens": 5, "temperature": 1.0, "stop_token": "none"},
        "reward": {"sources": [{"kind": "function", "path": f"{tmp_path / 'reward.py'}:length"}]},
        "ppo": {"num_epochs": 1, "num_minibatches": 2, "micro_batch_size": 4, "learning_rate": 1e-3},
        "log": {"trackers": [], "sample_every": 0},
        "checkpoint": {"every": 1},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    return tmp_path


def test_cli_resume_continues_exactly(cli_run, monkeypatch, capsys):
    cfg = str(cli_run / "config.yaml")
    assert main(["train", cfg, "--output_dir", str(cli_run / "straight")]) == 0
    monkeypatch.setenv("LMPPO_TEST_INTERRUPT_AT", "3")
    assert main(["train", cfg]) == 130  # interrupted in iteration 3
    assert "--resume" in capsys.readouterr().err
    monkeypatch.delenv("LMPPO_TEST_INTERRUPT_AT")
    assert main(["train", "--resume", str(cli_run / "run")]) == 0
    assert_same_logs(str(cli_run / "straight"), str(cli_run / "run"))
    from safetensors.torch import load_file

    a = load_file(str(cli_run / "straight" / "final" / "policy" / "model.safetensors"))
    b = load_file(str(cli_run / "run" / "final" / "policy" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "option, value, old",
    [
        ("rollout.batch_size", "4", 8),
        ("ppo.num_minibatches", "1", 2),
        ("value.mode", "critic", "shared"),
        ("model.lora.enabled", "true", False),
        ("seed", "1", 0),
    ],
)
def test_incompatible_change_is_refused_naming_field_and_values(cli_run, capsys, option, value, old):
    run = str(cli_run / "run")
    assert main(["train", str(cli_run / "config.yaml"), "--total_episodes", "8"]) == 0
    before = open(os.path.join(run, "config.yaml")).read()
    capsys.readouterr()
    assert main(["train", "--resume", run, f"--{option}", value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"`{option}`" in err and repr(old) in err and value in err.lower() and "resum" in err
    assert open(os.path.join(run, "config.yaml")).read() == before  # refused before anything was touched


def test_harmless_changes_are_allowed_and_api_refusals_are_config_errors(cli_run, tokenizer, capsys):
    run = str(cli_run / "run")
    assert main(["train", str(cli_run / "config.yaml"), "--total_episodes", "8"]) == 0
    assert (
        main(
            [
                "train",
                "--resume",
                run,
                "--total_episodes",
                "16",
                "--log.sample_every",
                "1",
                "--checkpoint.keep_last",
                "1",
                "--ppo.learning_rate",
                "0.0005",
            ]
        )
        == 0
    )
    assert [m["iteration"] for m in read_jsonl(os.path.join(run, "metrics.jsonl"))] == [1, 2]
    assert [i for i, _ in list_checkpoints(run)] == [2]
    with pytest.raises(ConfigError, match="total_episodes"):
        PPOTrainer.resume(run, overrides={"total_episodes": 8})  # fewer than already trained
    # a new learning rate applies from the next iteration, on the schedule's current step (linear decay)
    trainer = PPOTrainer.resume(run, overrides={"total_episodes": 32, "ppo.learning_rate": 0.002})
    assert trainer.updater.optimizer.param_groups[0]["lr"] == pytest.approx(0.002 * (1 - 2 / 4))
    assert trainer.updater.scheduler.base_lrs == [0.002]
    capsys.readouterr()
    assert main(["train", "--resume", str(cli_run / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_resume_of_a_run_without_checkpoint_says_so(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    assert main(["train", "--resume", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "no complete checkpoint" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(CheckpointError):
        PPOTrainer.resume(str(tmp_path / "run"))
