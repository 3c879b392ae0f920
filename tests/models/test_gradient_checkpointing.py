"""`model.gradient_checkpointing`: HF gradient checkpointing on the policy (and a separate critic), with LoRA too.

lmppo keeps its models in eval mode while HF checkpoints a layer only in training mode: these tests show the
layers are really recomputed in the backward pass (a layer's MLP runs twice per training pass), that the gradients
are those of the run without checkpointing, and that dropout stays off.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import PROMPTS, frac_target_reward, tiny_llama
from lmppo.config import Config
from lmppo.errors import ConfigError
from lmppo.models.loading import (
    checkpointed_layers,
    enable_gradient_checkpointing,
    hf_model,
    is_checkpointing,
    policy_forward,
    prepare_policy,
)
from lmppo.sampling.hf import left_pad
from lmppo.training.trainer import PPOTrainer


def _batch(tokenizer):
    ids, mask = left_pad([tokenizer.encode(p) for p in PROMPTS], tokenizer.pad_token_id)
    response = (torch.arange(4 * len(PROMPTS)).reshape(len(PROMPTS), 4) * 7) % 50 + 5
    return (
        torch.cat([ids, response], 1),
        torch.cat([mask, torch.ones_like(response, dtype=torch.bool)], 1),
        ids.shape[1],
        response,
    )


def _count_mlp_runs(policy) -> list:
    """A list that grows by one each time layer 0's MLP runs (its forward wrapped on the instance: module hooks do
    not fire when torch's checkpoint recomputes a layer)."""
    mlp, calls = hf_model(policy).model.layers[0].mlp, []
    forward = mlp.forward

    def counting(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    mlp.forward = counting
    return calls


def _grads_and_mlp_calls(policy, tokenizer):
    """(gradients of a log-likelihood loss, how often layer 0's MLP ran in its forward + backward)."""
    calls = _count_mlp_runs(policy)
    full, att, P, response = _batch(tokenizer)
    logits = policy_forward(policy, full, att, P, 0.7).logits
    loss = -torch.log_softmax(logits, -1).gather(-1, response[..., None]).mean()
    loss.backward()
    n = len(calls)
    calls.clear()
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}, n


@pytest.mark.parametrize("lora", [False, True])
def test_checkpointing_recomputes_layers_and_keeps_the_gradients(tokenizer, lora):
    mc = Config().model
    mc.lora.enabled, mc.lora.r = lora, 4
    plain = prepare_policy(tiny_llama(tokenizer), mc)
    if lora:  # the adapters start at B = 0; move them so that every LoRA factor gets a gradient
        with torch.no_grad():
            for n, p in plain.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
    checkpointed = copy.deepcopy(plain)
    enable_gradient_checkpointing(checkpointed)
    assert is_checkpointing(checkpointed) and not is_checkpointing(plain)
    assert hf_model(checkpointed).is_activation_checkpointing  # transformers' own flag (was is_gradient_checkpointing)
    assert len(checkpointed_layers(checkpointed)) == 2

    grads, calls = _grads_and_mlp_calls(plain, tokenizer)
    grads_ckpt, calls_ckpt = _grads_and_mlp_calls(checkpointed, tokenizer)
    assert (calls, calls_ckpt) == (1, 2)  # forward, then the recomputation in the backward pass
    assert grads.keys() == grads_ckpt.keys() and (all(".lora_" in n for n in grads) if lora else len(grads) > 10)
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], atol=1e-6, rtol=1e-5, msg=name)
    calls = _count_mlp_runs(checkpointed)
    with torch.no_grad():  # no gradient: no checkpoint (sampling and logprob passes run as before)
        full, att, P, _ = _batch(tokenizer)
        policy_forward(checkpointed, full, att, P, 0.7)
    assert len(calls) == 1


def test_dropout_stays_off_under_checkpointing(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        attention_dropout=0.5,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = prepare_policy(LlamaForCausalLM(cfg), Config().model)
    model.config._attn_implementation = "eager"  # eager attention applies its dropout when in training mode
    enable_gradient_checkpointing(model)
    full, att, P, _ = _batch(tokenizer)
    first = policy_forward(model, full, att, P, 1.0).logits
    second = policy_forward(model, full, att, P, 1.0).logits
    assert torch.equal(first, second)  # with the attention's dropout on (p = 0.5) these would differ


def _trainer(tokenizer, tmp_path, checkpointing: bool) -> PPOTrainer:
    cfg = Config()
    cfg.precision, cfg.seed = "fp32", 3
    cfg.output_dir, cfg.overwrite, cfg.log.trackers, cfg.log.sample_every = str(tmp_path), True, [], 0
    cfg.total_episodes, cfg.rollout.batch_size, cfg.rollout.max_new_tokens = 16, 8, 6
    cfg.rollout.temperature, cfg.rollout.stop_token = 1.0, "none"
    cfg.ppo.learning_rate, cfg.ppo.num_epochs, cfg.ppo.micro_batch_size = 1e-2, 2, 4
    cfg.model.lora.enabled, cfg.model.lora.r = True, 4
    cfg.value.mode, cfg.value.init_from = "critic", "policy"
    cfg.model.gradient_checkpointing = checkpointing
    return PPOTrainer(
        cfg,
        policy=tiny_llama(tokenizer),
        tokenizer=tokenizer,
        prompts=list(PROMPTS),
        reward_functions=[frac_target_reward(tokenizer)],
    )


def test_training_with_checkpointing_matches_training_without(tokenizer, tmp_path):
    """LoRA policy + separate critic, two iterations: the option reaches both models, and the metrics and trained
    weights are those of the run without it (up to float rounding)."""
    with_ckpt = _trainer(tokenizer, tmp_path / "a", True)
    assert is_checkpointing(with_ckpt.policy)
    assert is_checkpointing(with_ckpt.accelerator.unwrap_model(with_ckpt.critic).model)
    without = _trainer(tokenizer, tmp_path / "b", False)
    assert not is_checkpointing(without.policy)
    runs_ckpt, runs = _count_mlp_runs(with_ckpt.policy), _count_mlp_runs(without.policy)
    history_ckpt, history = with_ckpt.train(), without.train()
    assert is_checkpointing(with_ckpt.policy)  # still on after training (nothing switched the layers back)
    # every training pass ran layer 0 once more, in its backward: 2 iterations x 2 epochs x 2 micro-batches
    assert len(runs_ckpt) - len(runs) == 8, (len(runs_ckpt), len(runs))
    for key in ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "policy/approxkl_avg"):
        got, want = [m[key] for m in history_ckpt], [m[key] for m in history]
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6), key
    trained = {n: p for n, p in with_ckpt.policy.named_parameters() if p.requires_grad}
    for n, p in without.policy.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(trained[n], p, atol=1e-5, rtol=1e-4, msg=n)
    assert any((p != 0).any() for n, p in trained.items() if "lora_B" in n)  # the adapters did train


def test_a_model_without_checkpointing_support_is_refused(tokenizer):
    class NoSupport(torch.nn.Module):
        supports_gradient_checkpointing = False

    with pytest.raises(ConfigError, match="model.gradient_checkpointing"):
        enable_gradient_checkpointing(NoSupport())
