"""`ppo.reuse_rollout_forward`: with one minibatch that is one micro-batch, the rollout's policy/value pass (graph
kept) is the first epoch's forward. The update must be the one the plain path makes, with one forward fewer."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS, count_forward_calls, small_config, tiny_llama
from lmppo.models.loading import Actor, Critic
from lmppo.training.trainer import PPOTrainer


def length_reward(prompts, completions):
    return [len(c) / 20.0 for c in completions]


def make_trainer(tmp_path, tokenizer, reuse: bool = True, **fields):
    fields = {
        "ppo__micro_batch_size": 8,
        "ppo__num_minibatches": 1,
        "ppo__num_epochs": 3,
        "ppo__reuse_rollout_forward": reuse,
        **fields,
    }
    cfg = small_config(tmp_path / ("reuse" if reuse else "plain"), iterations=3, batch=8, **fields)
    return PPOTrainer(
        cfg,
        policy=tiny_llama(tokenizer, seed=4),
        tokenizer=tokenizer,
        prompts=PROMPTS,
        reward_functions=[length_reward],
    )


def relative_difference(a: list[torch.Tensor], b: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    """|(a - start) - (b - start)| / |b - start| over all tensors: how far apart two updates are."""
    diff = sum(float(((x - y) ** 2).sum()) for x, y in zip(a, b))
    size = sum(float(((y - s) ** 2).sum()) for y, s in zip(b, start))
    return (diff / size) ** 0.5


@pytest.mark.parametrize("value_mode,precision", [("critic", "fp32"), ("shared", "fp32"), ("critic", "bf16")])
def test_reused_forward_makes_the_plain_update_with_one_pass_fewer(
    tmp_path, tokenizer, monkeypatch, value_mode, precision
):
    actor_calls, critic_calls = count_forward_calls(monkeypatch, Actor), count_forward_calls(monkeypatch, Critic)
    runs = {}
    for reuse in (False, True):
        actor_calls.clear(), critic_calls.clear()
        trainer = make_trainer(tmp_path, tokenizer, reuse, value__mode=value_mode, precision=precision)
        start = [p.detach().clone() for p in trainer.updater.trainable_params]
        history = trainer.train()
        runs[reuse] = dict(
            history=history,
            params=[p.detach().clone() for p in trainer.updater.trainable_params],
            start=start,
            actor=list(actor_calls),
            critic=list(critic_calls),
        )
    plain, reused = runs[False], runs[True]
    # 3 iterations x 3 epochs of training passes; the plain path adds one no-grad rollout pass per iteration
    assert plain["actor"].count(True) == 9 and plain["actor"].count(False) == 3
    assert reused["actor"].count(True) == 9 and reused["actor"].count(False) == 0
    if value_mode == "critic":
        assert (plain["critic"].count(True), plain["critic"].count(False)) == (9, 3)
        assert (reused["critic"].count(True), reused["critic"].count(False)) == (9, 0)
    # the same update: the weights moved by lr 1e-3 for 9 steps; the two paths differ by float rounding only
    # (the plain path's old logprobs come from another pass shape, so its first ratios are 1 +- 1e-7)
    assert relative_difference(reused["params"], plain["params"], plain["start"]) < 1e-3
    for a, b in zip(plain["history"], reused["history"]):
        for name in (
            "objective/scores",
            "objective/kl",
            "loss/policy_avg",
            "loss/value_avg",
            "policy/clipfrac_avg",
            "val/ratio",
        ):
            assert a[name] == pytest.approx(b[name], rel=1e-3, abs=1e-5), name


def test_reuse_applies_only_to_one_minibatch_of_one_micro_batch(tmp_path, tokenizer):
    cases = {
        "one micro-batch": ({}, True),
        "switched off": ({"reuse": False}, False),
        "two minibatches": ({"ppo__num_minibatches": 2, "ppo__micro_batch_size": 4}, False),
        "two micro-batches": ({"ppo__micro_batch_size": 4}, False),
        "chunked rollout pass": ({"rollout__forward_batch_size": 4}, False),
    }
    for name, (fields, expected) in cases.items():
        trainer = make_trainer(tmp_path / name.replace(" ", "_"), tokenizer, **fields)
        rollout = trainer.collect_rollout()
        kept = trainer.updater.first_epoch_forward
        assert (kept is not None) is expected, name
        if kept is not None:  # the kept pass carries the graph and agrees with the rollout's old values
            assert kept.logits.requires_grad and kept.values.requires_grad
            lengths = rollout.response_mask
            assert torch.equal(kept.values[:, :-1].detach()[lengths], rollout.values[lengths])


def test_reused_forward_is_used_once_then_dropped(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, True)
    trainer.train()
    assert trainer.updater.first_epoch_forward is None  # no graph held between iterations (nor in a checkpoint)


@pytest.mark.parametrize("reference_mode", ["sync", "frozen"])
def test_reuse_with_lora_and_a_reference_adapter(tmp_path, tokenizer, reference_mode):
    """With LoRA the reference is an adapter swapped into the policy in place (`sync`) or the policy with its
    adapters off (`frozen`); neither may touch what the kept graph saved, and the update stays the plain one."""
    from lmppo.config import LoraConfig

    finals = {}
    for reuse in (False, True):
        trainer = make_trainer(
            tmp_path / reference_mode,
            tokenizer,
            reuse,
            model__lora=LoraConfig(enabled=True, r=4),
            reference__mode=reference_mode,
            reference__every=1,
        )
        start = [p.detach().clone() for p in trainer.updater.trainable_params]
        history = trainer.train()
        if reference_mode == "frozen":  # the adapters moved the policy away from its base
            assert history[-1]["objective/kl"] != 0.0
        finals[reuse] = (start, [p.detach().clone() for p in trainer.updater.trainable_params])
    assert relative_difference(finals[True][1], finals[False][1], finals[False][0]) < 1e-3


def test_reuse_with_hf_generate_entropy_bonus_and_kl_in_the_loss(tmp_path, tokenizer):
    """The kept pass feeds every term of the loss: the entropy bonus and the KL term read its logits. With HF
    generate the responses can carry padding columns past the longest response, which the kept pass must trim
    as the plain pass does."""
    fields = dict(
        rollout__backend="hf", ppo__entropy_coef=0.5, kl__placement="loss", kl__coef=2.0, kl__controller="fixed"
    )
    finals = {}
    for reuse in (False, True):
        torch.manual_seed(0)  # HF generate draws from the global generator
        trainer = make_trainer(tmp_path / "hf", tokenizer, reuse, **fields)
        start = [p.detach().clone() for p in trainer.updater.trainable_params]
        history = trainer.train()
        assert "loss/kl_avg" in history[-1]
        finals[reuse] = (start, [p.detach().clone() for p in trainer.updater.trainable_params], history)
    assert relative_difference(finals[True][1], finals[False][1], finals[False][0]) < 1e-3
    for a, b in zip(finals[False][2], finals[True][2]):
        assert a["loss/kl_avg"] == pytest.approx(b["loss/kl_avg"], rel=1e-3, abs=1e-6)
        assert a["policy/entropy_avg"] == pytest.approx(b["policy/entropy_avg"], rel=1e-4)
