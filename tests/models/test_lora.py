"""LoRA end to end: training updates only the adapters, and the reference is the base model with the adapters
switched off (no second copy of the weights)."""

from __future__ import annotations

import copy
import os

import torch

from conftest import PROMPTS, frac_target_reward, tiny_llama
from lmppo.config import Config
from lmppo.core.logprobs import selective_log_softmax
from lmppo.models.loading import hf_model, policy_forward
from lmppo.sampling.hf import left_pad
from lmppo.training.trainer import PPOTrainer


def lora_trainer(tokenizer, tmp_path, iterations: int = 4, **overrides) -> PPOTrainer:
    frac_target = frac_target_reward(tokenizer)

    cfg = Config()
    cfg.precision = "fp32"  # the same numbers on every CPU (`auto` picks bf16 where it is native)
    cfg.output_dir, cfg.overwrite, cfg.log.trackers, cfg.log.sample_every = str(tmp_path), True, [], 0
    cfg.total_episodes, cfg.rollout.batch_size, cfg.rollout.max_new_tokens = 8 * iterations, 8, 6
    cfg.rollout.temperature, cfg.rollout.stop_token = 1.0, "none"
    cfg.ppo.learning_rate, cfg.ppo.num_epochs, cfg.ppo.micro_batch_size = 3e-2, 2, 4
    cfg.kl.controller, cfg.kl.coef = "fixed", 0.05
    cfg.model.lora.enabled, cfg.model.lora.r = True, 4
    for dotted, value in overrides.items():
        section, name = dotted.split("__")
        setattr(getattr(cfg, section), name, value)
    return PPOTrainer(
        cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=list(PROMPTS), reward_functions=[frac_target]
    )


@torch.no_grad()
def logprobs(model, tokenizer):
    ids, mask = left_pad([tokenizer.encode(p) for p in PROMPTS], tokenizer.pad_token_id)
    response = torch.arange(3 * len(PROMPTS)).reshape(len(PROMPTS), 3) + 10
    full = torch.cat([ids, response], 1)
    att = torch.cat([mask, torch.ones_like(response, dtype=torch.bool)], 1)
    return selective_log_softmax(policy_forward(model, full, att, ids.shape[1], 0.7).logits, response)


def test_lora_training_with_the_adapter_off_reference(tokenizer, tmp_path):
    base = tiny_llama(tokenizer)  # the same initial weights as the trainer's policy, kept aside
    trainer = lora_trainer(tokenizer, tmp_path)
    policy = trainer.policy
    base_weights = {n: p.detach().clone() for n, p in hf_model(policy).named_parameters() if not p.requires_grad}

    # no second copy: the reference holds no tensor, and only adapter tensors are trained
    assert trainer.reference.adapter_off and trainer.reference.model is None and not trainer.reference.adapter
    trained = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)

    history = trainer.train()
    assert history[0]["objective/kl"] == 0.0  # adapters start at B = 0: the policy *is* the reference, bit for bit
    assert all(abs(m["objective/kl"]) > 1e-4 for m in history[1:])
    # the base weights did not move; the adapters did; the reference is still exactly the untouched base model
    for n, p in hf_model(policy).named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base_weights[n]), n
    assert any(p.abs().sum() > 0 for n, p in policy.named_parameters() if "lora_B" in n)
    assert not torch.allclose(logprobs(policy, tokenizer), logprobs(base, tokenizer), atol=1e-4)
    with policy.disable_adapter():
        assert torch.allclose(logprobs(policy, tokenizer), logprobs(base, tokenizer), atol=1e-6)
    assert trainer.reference.state_dict() == {"mode": "frozen"}
    # the exported policy is the adapter (the base model is the user's own)
    exported = os.listdir(os.path.join(tmp_path, "final", "policy"))
    assert "adapter_config.json" in exported and "adapter_model.safetensors" in exported


def test_lora_with_a_critic_starts_the_critic_from_the_base_weights(tokenizer, tmp_path):
    """value.mode critic with value.init_from policy copies the policy's trunk: with LoRA injected its weights
    sit under `base_layer`, and must still land in the critic (not a random initialisation)."""
    base = tiny_llama(tokenizer)
    trainer = lora_trainer(tokenizer, tmp_path, iterations=2, value__mode="critic", value__init_from="policy")
    critic = trainer.accelerator.unwrap_model(trainer.critic)
    for (name, want), (_, got) in zip(base.model.named_parameters(), critic.trunk.named_parameters()):
        assert torch.equal(want, got), name
    history = trainer.train()
    assert len(history) == 2 and history[0]["objective/kl"] == 0.0


def test_lora_reference_follows_the_policy_with_sync(tokenizer, tmp_path):
    """sync every iteration: at every rollout the reference adapter equals the policy's, so the KL is exactly 0,
    while the policy itself keeps moving away from the base model."""
    base = tiny_llama(tokenizer)
    trainer = lora_trainer(tokenizer, tmp_path, iterations=3, reference__mode="sync", reference__every=1)
    history = trainer.train()
    assert [m["objective/kl"] for m in history] == [0.0, 0.0, 0.0]
    assert [m["reference/updated"] for m in history] == [1.0, 1.0, 1.0]
    assert trainer.reference.model is None and all(".lora_" in n for n in trainer.reference.adapter)
    assert not torch.allclose(logprobs(trainer.policy, tokenizer), logprobs(base, tokenizer), atol=1e-4)
    ids, mask = left_pad([tokenizer.encode(p) for p in PROMPTS], tokenizer.pad_token_id)
    response = torch.full((len(PROMPTS), 2), 11)
    full, att = torch.cat([ids, response], 1), torch.cat([mask, torch.ones_like(response, dtype=torch.bool)], 1)
    with torch.no_grad():
        ref = trainer.reference.logprobs(trainer.policy, full, att, ids.shape[1], response, 0.7)
    twin = copy.deepcopy(trainer.policy)  # the policy after its last update = what the last sync copied
    with torch.no_grad():
        own = selective_log_softmax(policy_forward(twin, full, att, ids.shape[1], 0.7).logits, response)
    assert torch.equal(ref, own)
