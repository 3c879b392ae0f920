"""A run whose responses never earn a reward says so once on the console (`lmppo.training.report.SignalWatch`),
and a run with a signal says nothing."""

from __future__ import annotations

import warnings

import torch

from conftest import PROMPTS, small_config, tiny_llama
from lmppo.training.report import SignalWatch
from lmppo.training.scoring import RewardSignal
from lmppo.training.trainer import PPOTrainer

NONE = RewardSignal(rows=torch.zeros(4, dtype=torch.bool), any=False)
SOME = RewardSignal(rows=torch.ones(4, dtype=torch.bool), any=True)


def said(signals) -> list[str]:
    watch = SignalWatch(tolerance=1e-6, batches=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for signal in signals:
            watch.see(signal)
    return [str(w.message) for w in caught]


def test_three_batches_in_a_row_without_a_signal_are_said_once():
    assert said([NONE, NONE, SOME, NONE, NONE]) == []  # the streak restarts at a batch with a signal
    (line,) = said([NONE, NONE, NONE, NONE, NONE, NONE])
    assert line.startswith("no reward signal in 3 batches in a row: every response of a batch")
    assert "ppo.signal_tolerance (1e-06)" in line


def run(tmp_path, tokenizer, reward) -> list[str]:
    cfg = small_config(tmp_path / "run", iterations=3, batch=4, ppo__num_epochs=1, ppo__micro_batch_size=2)
    trainer = PPOTrainer(
        cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=PROMPTS, reward_functions=[reward]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return [str(w.message) for w in caught if "no reward signal" in str(w.message)]


def test_a_run_that_never_earns_a_reward_says_so_and_one_that_does_does_not(tmp_path, tokenizer):
    def never(prompts, completions):
        return [0.0] * len(completions)

    def length(prompts, completions):
        return [len(c) / 20.0 for c in completions]

    assert len(run(tmp_path / "never", tokenizer, never)) == 1
    assert run(tmp_path / "length", tokenizer, length) == []
