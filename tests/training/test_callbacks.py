"""Callbacks (lmppo.training.callbacks) and the held-out evaluation during training (`log.eval_every`).

Checked: the hooks run in the documented order with the documented arguments; `trainer.stop()` ends the run after
the current iteration with its checkpoint and final model; the evaluation logs `eval/*` without changing a single
training metric (it samples on its own random streams); `lmppo plot` draws it; mistakes are one-line errors.
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import tiny_llama
from lmppo.config import Config
from lmppo.errors import ConfigError, LmppoError
from lmppo.training.callbacks import Callback, CallbackList
from lmppo.training.trainer import PPOTrainer

PROMPTS = [f"prompt number {i}" for i in range(12)]


def brevity(prompts, completions):
    return [-len(c) / 10 for c in completions]


def config(tmp_path, iterations=2, name="run", **log):
    cfg = Config()
    cfg.precision, cfg.output_dir, cfg.log.trackers = "fp32", str(tmp_path / name), []
    cfg.rollout.batch_size, cfg.rollout.max_new_tokens = 4, 4
    cfg.ppo.num_epochs, cfg.ppo.micro_batch_size, cfg.total_episodes = 1, 4, 4 * iterations
    cfg.data.holdout = 4
    for k, v in log.items():
        setattr(cfg.log, k, v)
    return cfg


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, trainer):
        self.events.append(("begin", trainer.iteration))

    def on_evaluate(self, trainer, metrics):
        self.events.append(("evaluate", trainer.iteration, sorted(metrics)))

    def on_log(self, trainer, metrics):
        self.events.append(("log", metrics["iteration"]))

    def on_iteration_end(self, trainer, metrics):
        self.events.append(("iteration_end", metrics["iteration"]))

    def on_save(self, trainer, path):
        self.events.append(("save", os.path.relpath(path, trainer.config.output_dir)))

    def on_train_end(self, trainer, history):
        self.events.append(("end", len(history)))


def test_hooks_run_in_order_with_their_arguments(tokenizer, tmp_path):
    rec = Recorder()
    cfg = config(tmp_path)
    cfg.checkpoint.every = 1
    PPOTrainer(
        cfg,
        policy=tiny_llama(tokenizer),
        tokenizer=tokenizer,
        prompts=PROMPTS,
        reward_functions=[brevity],
        callbacks=[rec],
    ).train()
    saves = [e for e in rec.events if e[0] == "save"]
    assert [e for e in rec.events if e[0] != "save"] == [
        ("begin", 0),
        ("log", 1),
        ("iteration_end", 1),
        ("log", 2),
        ("iteration_end", 2),
        ("end", 2),
    ]
    assert len(saves) == 3 and saves[-1] == ("save", "final")
    assert all(s[1].startswith("checkpoints") for s in saves[:2])
    assert rec.events.index(saves[0]) == rec.events.index(("iteration_end", 1)) + 1


def test_stop_ends_the_run_after_the_current_iteration(tokenizer, tmp_path, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)  # the Python API's bar is on (log.progress's default)

    class StopAtOne:  # any object with some of the hooks works, no subclassing needed
        def on_iteration_end(self, trainer, metrics):
            if metrics["iteration"] == 1:
                trainer.stop()

    cfg = config(tmp_path, iterations=3)
    trainer = PPOTrainer(
        cfg,
        policy=tiny_llama(tokenizer),
        tokenizer=tokenizer,
        prompts=PROMPTS,
        reward_functions=[brevity],
        callbacks=[StopAtOne()],
    )
    history = trainer.train()
    assert len(history) == 1 and trainer.iteration == 1
    assert os.path.isdir(os.path.join(cfg.output_dir, "final", "policy"))
    assert os.listdir(os.path.join(cfg.output_dir, "checkpoints")) == ["iter-00000001"]
    # the bar stopped at 1/3 is closed with the run: an open one prints itself again when collected or at exit
    from tqdm.auto import tqdm

    assert [bar.n for bar in tqdm._instances if bar.desc == "PPO"] == []


def test_bad_callbacks_are_one_line_errors():
    with pytest.raises(LmppoError, match="is the class Recorder, not an instance"):
        CallbackList([Recorder])
    with pytest.raises(LmppoError, match=r"callbacks\[0\] \(int\) has none of the hooks"):
        CallbackList([3])
    assert len(CallbackList(Recorder())) == 1  # one callback, not in a list


def test_eval_every_logs_eval_metrics_and_changes_no_training_metric(tokenizer, tmp_path):
    rec = Recorder()
    plain = PPOTrainer(
        config(tmp_path, name="plain"),
        policy=tiny_llama(tokenizer),
        tokenizer=tokenizer,
        prompts=PROMPTS,
        reward_functions=[brevity],
    ).train()
    cfg = config(tmp_path, name="eval", eval_every=1)
    with_eval = PPOTrainer(
        cfg,
        policy=tiny_llama(tokenizer),
        tokenizer=tokenizer,
        prompts=PROMPTS,
        reward_functions=[brevity],
        callbacks=[rec],
    ).train()
    for a, b in zip(plain, with_eval):
        for k, v in a.items():
            if not k.startswith(("time/", "eps", "tokens_per_s")):
                assert b[k] == v, k
    expected = {
        "eval/score",
        "eval/reward/brevity",
        "eval/kl",
        "eval/kl_k3",
        "eval/kl_exact",
        "eval/length",
        "eval/terminated_frac",
    }
    for row in with_eval:
        assert expected <= set(row)
        assert row["eval/score"] == pytest.approx(row["eval/reward/brevity"])
    written = [json.loads(x) for x in open(os.path.join(cfg.output_dir, "metrics.jsonl"))]
    assert all(expected <= set(r) for r in written)
    assert [e[1] for e in rec.events if e[0] == "evaluate"] == [1, 2]


def test_eval_every_needs_held_out_prompts(tokenizer, tmp_path):
    cfg = config(tmp_path, eval_every=2)
    cfg.data.holdout = 0
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert "log.eval_every" in str(err.value) and "data.holdout" in str(err.value) and "\n" not in str(err.value)


def test_plot_draws_the_eval_metrics_on_their_panels(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from lmppo.evaluation.plot import eval_key, plot_runs

    assert eval_key("objective/scores") == "eval/score" and eval_key("reward/judge") == "eval/reward/judge"
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as fh:
        for i in range(4):
            row = {"episode": 4 * (i + 1), "objective/scores": 0.1 * i, "objective/kl": 0.2 * i}
            if i % 2:
                row.update({"eval/score": 0.5 + i, "eval/kl": 0.01 * i})
            fh.write(json.dumps(row) + "\n")
    drawn = []
    original = matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):
        if kwargs.get("linestyle") == "--":
            drawn.append((list(args[0]), list(args[1])))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    plot_runs([str(run)], str(tmp_path / "c.png"))
    assert ([8.0, 16.0], [1.5, 3.5]) in drawn and ([8.0, 16.0], [0.01, 0.03]) in drawn
