"""Trackers besides metrics.jsonl: TensorBoard, Weights & Biases (offline) and trackio, selected by log.trackers.

None of them is required: a tracker test skips, saying why, only when its package is not installed; a tracker
named in the config whose package is missing is a one-line LmppoError.
"""

from __future__ import annotations

import glob
import json
import os
import sys

import pytest

from conftest import PROMPTS, REPO, TESTS, tiny_llama  # noqa: E402
from lmppo.config import Config
from lmppo.errors import LmppoError
from lmppo.training.metrics import TRACKERS, make_trackers
from lmppo.training.trainer import PPOTrainer


def reward(prompts, completions):
    return [len(c) / 10.0 for c in completions]


def train_with(tracker: str, tmp_path, tokenizer) -> PPOTrainer:
    cfg = Config()
    cfg.precision = "fp32"  # the same numbers on every CPU (`auto` picks bf16 where it is native)
    cfg.output_dir = str(tmp_path / "run")
    cfg.total_episodes, cfg.rollout.batch_size, cfg.rollout.max_new_tokens = 16, 8, 5
    cfg.ppo.micro_batch_size, cfg.ppo.num_epochs = 4, 1
    cfg.log.trackers, cfg.log.sample_every, cfg.log.num_samples = [tracker], 1, 2
    trainer = PPOTrainer(
        cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=PROMPTS, reward_functions=[reward]
    )
    trainer.train()
    return trainer


def test_registry_holds_the_three_trackers():
    assert {"tensorboard", "wandb", "trackio"} <= set(TRACKERS)


def test_tensorboard_gets_every_iteration(tmp_path, tokenizer):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = train_with("tensorboard", tmp_path, tokenizer)
    acc = EventAccumulator(os.path.join(trainer.config.output_dir, "tensorboard"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("objective/kl")]
    assert steps == [8, 16]
    assert "samples" in acc.Tags()["tensors"] or any("samples" in t for t in acc.Tags()["tensors"])


def test_wandb_offline_run_in_the_output_dir(tmp_path, tokenizer, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb package is not installed (pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "lmppo-test")
    trainer = train_with("wandb", tmp_path, tokenizer)
    runs = glob.glob(os.path.join(trainer.config.output_dir, "wandb", "offline-run-*"))
    assert len(runs) == 1, runs
    data = open(glob.glob(os.path.join(runs[0], "run-*.wandb"))[0], "rb").read()
    for name in ("objective/kl", "objective/scores", "reward/reward", "policy/clipfrac_avg"):
        assert name.encode() in data, name  # the metric names are in the run's record file
    tables = sorted(glob.glob(os.path.join(runs[0], "files", "media", "table", "samples_*.table.json")))
    assert len(tables) == 2  # one sample table per iteration (sample_every 1)
    table = json.load(open(tables[0]))
    assert table["columns"][:3] == ["prompt", "response", "score"] and len(table["data"]) == 2


TRACKIO_SCRIPT = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + '/training']
from pathlib import Path
from conftest import tiny_llama
from helpers_tokenizers import make_bpe_tokenizer
import test_metrics
test_metrics.train_with("trackio", Path(sys.argv[2]), make_bpe_tokenizer())
from trackio.sqlite_storage import SQLiteStorage
print("LOGS=" + json.dumps(SQLiteStorage.get_logs("lmppo-test", "run")))
"""


def test_trackio_run_holds_the_metrics(tmp_path):
    pytest.importorskip("trackio", reason="the trackio package is not installed (pip install trackio)")
    import subprocess

    # a child process: trackio reads TRACKIO_DIR once, at import, so the test's database stays in tmp_path
    here = TESTS
    env = {
        **os.environ,
        "TRACKIO_DIR": str(tmp_path / "trackio"),
        "TRACKIO_PROJECT": "lmppo-test",
        "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(here), "src"), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", TRACKIO_SCRIPT, here, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    logs = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("LOGS="))[5:])
    scalars = [row for row in logs if "objective/kl" in row]
    assert [row["step"] for row in scalars] == [8, 16]
    assert all("reward/reward" in row and "episode" in row for row in scalars)
    assert (tmp_path / "trackio" / "lmppo-test.db").exists()


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_a_missing_tracker_package_is_a_one_line_error(name, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
    with pytest.raises(LmppoError, match=rf"`{name}` but its package is missing.*pip install {name}"):
        make_trackers([name], str(tmp_path), {}, "run")


def test_a_tracker_that_cannot_start_is_a_one_line_error(tmp_path, monkeypatch):
    class Broken:
        def __init__(self, *args):
            raise RuntimeError("api_key not configured (no-tty)\nmore lines")

    closed = []

    class Fine:
        def __init__(self, *args):
            pass

        def close(self):
            closed.append(True)

    monkeypatch.setitem(TRACKERS, "fine", Fine)
    monkeypatch.setitem(TRACKERS, "wandb", Broken)
    with pytest.raises(
        LmppoError,
        match=r"`wandb` could not start: RuntimeError: api_key not configured "
        r"\(no-tty\) \(set WANDB_MODE=offline",
    ):
        make_trackers(["fine", "wandb"], str(tmp_path), {}, "run")
    assert closed == [True]  # the tracker already started is closed


def _documented(name: str, doc: str) -> bool:
    """`name` appears in the metric guide literally or through its pattern (reward/<name>, time/<phase>, ...)."""
    import re

    patterns = {
        r"^reward/(?!num_invalid$).+": "`reward/<name>`",
        r"^time/.+": "`time/<phase>`",
        r"^truncation/.+_count$": "`truncation/<policy>_count`",
    }
    if f"`{name}`" in doc:
        return True
    return any(re.match(p, name) and token in doc for p, token in patterns.items())


@pytest.mark.parametrize(
    "options",
    [
        {},
        {
            "kl.placement": "both",
            "reference.mode": "sync",
            "reference.every": 1,
            "reward.truncation": "penalty",
            "value.mode": "critic",
        },
    ],
)
def test_every_logged_metric_is_in_the_metric_guide(tmp_path, tokenizer, options):
    """docs/metrics.md explains every name the trainer logs (so the guide cannot fall behind the code)."""
    from lmppo.config import apply_override

    cfg = Config()
    cfg.precision = "fp32"  # the same numbers on every CPU (`auto` picks bf16 where it is native)
    cfg.output_dir = str(tmp_path / "run")
    cfg.total_episodes, cfg.rollout.batch_size, cfg.rollout.max_new_tokens = 8, 8, 5
    cfg.ppo.micro_batch_size, cfg.ppo.num_epochs, cfg.log.trackers = 4, 1, []
    for key, value in options.items():
        apply_override(cfg, key, value)
    trainer = PPOTrainer(
        cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=PROMPTS, reward_functions=[reward]
    )
    names = set(trainer.train()[-1])
    doc = open(os.path.join(REPO, "docs", "metrics.md"), encoding="utf-8").read()
    missing = sorted(n for n in names if not _documented(n, doc))
    assert not missing, f"metrics logged but not explained in docs/metrics.md: {missing}"


def test_phase_timer_adds_up_each_phase_under_its_name():
    from lmppo.training.metrics import PhaseTimer

    timer = PhaseTimer()
    with timer("rollout"):
        pass
    first = timer.seconds["rollout"]
    with timer("rollout"):
        pass
    with timer("update"):
        pass
    assert set(timer.seconds) == {"rollout", "update"}
    assert timer.seconds["rollout"] >= first >= 0.0 and timer.seconds["update"] >= 0.0


def test_a_sample_table_is_due_on_the_first_iteration_then_every_sample_every():
    from lmppo.config import LogConfig
    from lmppo.training.report import samples_due

    log = LogConfig(sample_every=3, num_samples=2)
    assert [i for i in range(1, 10) if samples_due(log, i)] == [1, 3, 6, 9]
    assert not any(samples_due(LogConfig(sample_every=0, num_samples=2), i) for i in range(1, 5))
    assert not any(samples_due(LogConfig(sample_every=3, num_samples=0), i) for i in range(1, 5))
