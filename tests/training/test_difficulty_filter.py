"""The per-prompt difficulty filter (`data.retire_settled_after`) end to end on tiny in-process models: a prompt
whose group all scored alike is not drawn again; off, every pass draws every prompt."""

from __future__ import annotations

from conftest import PROMPTS, small_config, tiny_llama
from lmppo.training.trainer import PPOTrainer

SETTLED = set(PROMPTS[3:])  # these 5 prompts always score 1.0: every group of them is settled


class Reward:
    """1.0 for the settled prompts; a score that differs from response to response for the others."""

    def __init__(self):
        self.batches: list[list[str]] = []  # the prompts of each iteration, each once

    def __call__(self, prompts, completions):
        self.batches.append(list(dict.fromkeys(prompts)))
        return [1.0 if p in SETTLED else sum(map(ord, c)) % 97 / 97 for p, c in zip(prompts, completions)]


def run(tmp_path, tokenizer, retire_after: int) -> tuple[Reward, list[dict]]:
    reward = Reward()
    cfg = small_config(
        tmp_path / f"run{retire_after}",
        8,  # 8 iterations of 2 prompts x 4 responses: two passes over the 8 prompts
        8,
        ppo__advantage_estimator="grpo",
        rollout__num_samples_per_prompt=4,
        data__retire_settled_after=retire_after,
    )
    trainer = PPOTrainer(
        cfg, policy=tiny_llama(tokenizer, seed=1), tokenizer=tokenizer, prompts=PROMPTS, reward_functions=[reward]
    )
    return reward, trainer.train()


def test_settled_prompts_are_not_drawn_again(tmp_path, tokenizer):
    reward, history = run(tmp_path, tokenizer, 1)
    seen: set[str] = set()
    for batch in reward.batches:
        assert not (set(batch) & SETTLED & seen), f"a settled prompt came back: {batch}"
        seen |= set(batch)
    assert SETTLED <= seen  # each settled prompt was drawn once, then retired
    assert history[-1]["data/retired_prompts"] == len(SETTLED)
    drawn = [p for batch in reward.batches for p in batch]
    assert len(drawn) == 16 and len([p for p in drawn if p not in SETTLED]) == 16 - len(SETTLED)


def test_off_every_pass_draws_every_prompt(tmp_path, tokenizer):
    reward, history = run(tmp_path, tokenizer, 0)
    drawn = [p for batch in reward.batches for p in batch]
    assert sorted(drawn) == sorted(PROMPTS * 2)
    assert "data/retired_prompts" not in history[-1]


def test_settled_prompts_by_hand():
    """3 prompts x 2 responses: prompt 0 has a signal row, prompt 1 none (settled), prompt 2 only invalid responses
    (not settled: nothing was learned about it)."""
    import torch
    from accelerate import Accelerator

    from lmppo.distributed.strategy import Strategy
    from lmppo.training.batch import Rollout
    from lmppo.training.scoring import RewardSignal, settled_prompts

    class Groups:  # the one field of a Rollout that settled_prompts reads
        group_ids = torch.tensor([0, 0, 1, 1, 2, 2])

    signal = RewardSignal(rows=torch.tensor([True, True, False, False, False, False]), any=True)
    valid = torch.tensor([True, True, True, True, False, False])
    rollout: Rollout = Groups()  # type: ignore[assignment]
    assert settled_prompts(rollout, signal, valid, 3, Strategy(Accelerator(cpu=True))) == [False, True, False]
