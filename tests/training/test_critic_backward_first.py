"""A separate critic's value loss goes backward before the policy's training pass (`Updater.critic_backward_first`):
the two autograd graphs never hold memory at the same time, and the update is the one a single backward makes."""

from __future__ import annotations

import weakref
from collections import Counter

import pytest
import torch

from conftest import PROMPTS, count_forward_calls, small_config, tiny_llama
from lmppo.models.loading import Actor, Critic
from lmppo.training.trainer import PPOTrainer


def length_reward(prompts, completions):
    return [len(c) / 20.0 for c in completions]


def make_trainer(tmp_path, tokenizer, backward_first: bool | None = None, **fields) -> PPOTrainer:
    """A run with a separate critic; `backward_first` (when given) sets `Updater.critic_backward_first`."""
    cfg = small_config(tmp_path / f"first{backward_first}", iterations=2, batch=8, value__mode="critic", **fields)
    trainer = PPOTrainer(
        cfg,
        policy=tiny_llama(tokenizer, seed=4),
        tokenizer=tokenizer,
        prompts=PROMPTS,
        reward_functions=[length_reward],
    )
    if backward_first is not None:
        assert trainer.updater.critic_backward_first  # on for a learning critic without DeepSpeed
        trainer.updater.critic_backward_first = backward_first
    return trainer


class SavedTensors:
    """Counts, per model, the tensors autograd holds for a backward, and whether the actor's and the critic's were
    ever held at the same time."""

    def __init__(self, monkeypatch):
        self.live: Counter = Counter()
        self.owner: str | None = None
        self.overlaps = 0
        self.packed: Counter = Counter()
        for cls, name in ((Actor, "actor"), (Critic, "critic")):
            self._tag(monkeypatch, cls, name)

    def _tag(self, monkeypatch, cls, name):
        original = cls.forward

        def tagged(module, *args, **kwargs):
            outer, self.owner = self.owner, name
            try:
                return original(module, *args, **kwargs)
            finally:
                self.owner = outer

        monkeypatch.setattr(cls, "forward", tagged)

    def pack(self, tensor):
        holder = _Held(tensor)
        if self.owner is not None:
            other = "critic" if self.owner == "actor" else "actor"
            self.overlaps += self.live[other] > 0
            self.live[self.owner] += 1
            self.packed[self.owner] += 1
            weakref.finalize(holder, self.live.subtract, [self.owner])
        return holder

    @staticmethod
    def unpack(holder):
        return holder.tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    def __init__(self, tensor):
        self.tensor = tensor


@pytest.mark.parametrize("backward_first", [True, False])
def test_the_critic_graph_is_freed_before_the_policy_pass(tmp_path, tokenizer, monkeypatch, backward_first):
    saved = SavedTensors(monkeypatch)
    trainer = make_trainer(tmp_path, tokenizer, backward_first)
    with saved.hooks():
        trainer.train()
    assert saved.packed["actor"] > 0 and saved.packed["critic"] > 0  # both trained with graphs
    assert saved.live["actor"] == 0 and saved.live["critic"] == 0  # every graph was freed at the end
    if backward_first:
        assert saved.overlaps == 0
    else:  # one backward for both: the critic's pass runs while the actor's graph is held
        assert saved.overlaps > 0


def test_backward_first_makes_the_same_update(tmp_path, tokenizer):
    runs = {}
    for backward_first in (True, False):
        trainer = make_trainer(tmp_path, tokenizer, backward_first)
        history = trainer.train()
        params = [p.detach().clone() for p in trainer.updater.trainable_params]
        runs[backward_first] = (history, params)
    (first_history, first_params), (plain_history, plain_params) = runs[True], runs[False]
    assert len(first_params) == len(plain_params)
    for a, b in zip(first_params, plain_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(first_history, plain_history):
        for name in ("loss/policy_avg", "loss/value_avg", "val/clipfrac_avg", "policy/clipfrac_avg", "val/ratio"):
            assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-7), name


def test_a_critic_nobody_reads_runs_no_pass(tmp_path, tokenizer, monkeypatch):
    """grpo reads no values and trains none (`ppo.vf_coef` counts as 0): a separate critic is neither run nor
    stepped, and the policy's update is the one a run that passes the critic through everything makes."""
    calls = count_forward_calls(monkeypatch, Critic)
    grpo = {"ppo__advantage_estimator": "grpo", "rollout__num_samples_per_prompt": 2}
    runs = {}
    for skip in (True, False):
        calls.clear()
        trainer = make_trainer(tmp_path / f"skip{int(skip)}", tokenizer, **grpo)
        updater = trainer.updater
        assert (updater.critic_reads, updater.critic_learns, updater.critic_backward_first) == (False, False, False)
        if not skip:  # the critic run everywhere, as before: its loss weighs 0, so it moves nothing
            updater.critic_reads = updater.critic_learns = updater.critic_backward_first = True
        critic_start = [p.detach().clone() for p in trainer.critic.parameters()]
        trainer.train()
        runs[skip] = [p.detach().clone() for p in trainer.policy.parameters() if p.requires_grad], list(calls)
        if skip:
            assert calls == []
            for p, start in zip(trainer.critic.parameters(), critic_start):
                assert torch.equal(p, start)
                assert p.grad is None and not updater.optimizer.state.get(p)  # no gradient, no AdamW moments
    (skipped, _), (passed, passed_calls) = runs[True], runs[False]
    assert passed_calls.count(True) > 0 and passed_calls.count(False) > 0  # the forced run did pass the critic
    for a, b in zip(skipped, passed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_critic_with_no_loss_weight_gives_the_rollout_values_and_trains_no_pass(tmp_path, tokenizer, monkeypatch):
    """gae reads the values, `ppo.vf_coef 0` trains none: the critic's rollout pass runs, its training pass does not."""
    calls = count_forward_calls(monkeypatch, Critic)
    trainer = make_trainer(tmp_path, tokenizer, ppo__vf_coef=0.0)
    updater = trainer.updater
    assert (updater.critic_reads, updater.critic_learns, updater.critic_backward_first) == (True, False, False)
    critic_start = [p.detach().clone() for p in trainer.critic.parameters()]
    history = trainer.train()
    assert calls and not any(calls)  # rollout passes only, no graph
    for p, start in zip(trainer.critic.parameters(), critic_start):
        assert torch.equal(p, start)
    assert all(row["loss/value_avg"] > 0 for row in history)  # the value loss is still reported, on the old values
