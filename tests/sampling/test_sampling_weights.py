"""The native sampler's copy of the policy (lmppo.sampling.native.SamplingWeights): LoRA folded into plain linear
layers,
weights in the autocast dtype. It must compute what the adapter model computes, and follow every update."""

from __future__ import annotations

import torch
from torch import nn

from conftest import PROMPTS, small_config, tiny_llama
from lmppo.config import ModelConfig
from lmppo.models.loading import hf_model, prepare_policy
from lmppo.sampling.engines import HFEngine, NativeEngine, PromptBatch
from lmppo.sampling.hf import left_pad, pure_sampling_config, sample_responses
from lmppo.sampling.native import SamplingWeights, response_seed, sample_native
from lmppo.sampling.settings import Sampling
from lmppo.training.assembly import build_components
from lmppo.training.trainer import PPOTrainer


def lora_policy(tokenizer, seed: int = 0) -> nn.Module:
    mc = ModelConfig()
    mc.lora.enabled, mc.lora.r, mc.lora.alpha = True, 4, 8
    mc.lora.target_modules = ["all-linear"]
    policy = prepare_policy(tiny_llama(tokenizer, seed=seed), mc)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # PEFT starts B at zero (the fold would be W + 0): give the adapters real weights
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return policy


def batch(tokenizer):
    ids, mask = left_pad([tokenizer.encode(p) for p in PROMPTS[:4]], tokenizer.pad_token_id)
    return ids, mask


@torch.no_grad()
def logits_of(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return hf_model(model)(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits.float()


def test_the_folded_copy_gives_the_adapter_models_logits_with_plain_linear_layers(tokenizer):
    policy = lora_policy(tokenizer)
    ids, mask = batch(tokenizer)
    weights = SamplingWeights()
    copy = weights.model_for(policy)
    assert copy is not hf_model(policy)
    want, got = logits_of(policy, ids, mask), logits_of(copy, ids, mask)
    assert (want - logits_of(tiny_llama(tokenizer), ids, mask)).abs().max() > 0.1  # the adapters matter here
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not any(hasattr(m, "lora_A") for m in copy.modules())  # generation runs plain linear layers
    q_proj = copy.model.layers[0].self_attn.q_proj
    assert type(q_proj) is nn.Linear
    lora_q = hf_model(policy).model.layers[0].self_attn.q_proj
    a, b = lora_q.lora_A["default"].weight, lora_q.lora_B["default"].weight
    assert torch.allclose(q_proj.weight, lora_q.base_layer.weight + 2.0 * b @ a, atol=1e-6)  # alpha 8 / r 4
    # everything that is not a folded layer is shared with the policy, not copied
    assert copy.model.embed_tokens.weight is hf_model(policy).model.embed_tokens.weight
    assert copy.model.norm.weight is hf_model(policy).model.norm.weight


def test_the_copy_follows_a_fused_optimizer_step_of_the_adapters(tokenizer):
    policy = lora_policy(tokenizer)
    ids, mask = batch(tokenizer)
    weights = SamplingWeights()
    copy = weights.model_for(policy)
    before = logits_of(copy, ids, mask)
    adapters = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(adapters, lr=0.1, fused=True)  # in place, without bumping tensor versions
    for p in adapters:
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert weights.model_for(policy) is copy  # the same copy, its weights refreshed
    after = logits_of(copy, ids, mask)
    assert (after - before).abs().max() > 0.1
    assert torch.allclose(after, logits_of(policy, ids, mask), atol=1e-5, rtol=1e-5)


def test_the_native_sampler_draws_the_same_tokens_from_the_copy(tokenizer):
    policy = lora_policy(tokenizer)
    ids, mask = batch(tokenizer)
    seeds = [response_seed(0, 0, p) for p in range(ids.shape[0])]
    stop = torch.tensor([tokenizer.eos_token_id])
    unfolded = sample_native(policy, ids, mask, 1.0, 12, stop, tokenizer.pad_token_id, seeds)
    folded = sample_native(SamplingWeights().model_for(policy), ids, mask, 1.0, 12, stop, tokenizer.pad_token_id, seeds)
    assert all(torch.equal(a, b) for a, b in zip(unfolded, folded))


def test_under_bf16_autocast_the_copy_holds_bf16_weights_no_less_accurate_than_the_adapter_model(tokenizer):
    policy = lora_policy(tokenizer)
    ids, mask = batch(tokenizer)
    exact = logits_of(policy, ids, mask)
    weights = SamplingWeights()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        copy = weights.model_for(policy)
        folded, unfolded = logits_of(copy, ids, mask), logits_of(policy, ids, mask)
    assert copy.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert copy.lm_head.weight is hf_model(policy).lm_head.weight  # not a LoRA layer: shared, autocast casts it
    # one bf16 rounding of W + scale * B @ A instead of three roundings (W, A, B): as close to fp32 or closer
    assert (folded - exact).abs().mean() <= 1.5 * (unfolded - exact).abs().mean()
    assert (folded - exact).abs().max() < 0.05


def test_without_lora_the_sampler_runs_the_policy_itself(tokenizer):
    model = tiny_llama(tokenizer)
    weights = SamplingWeights()
    assert weights.model_for(model) is model
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert weights.model_for(model) is model
    assert weights.refreshes == 0


def test_each_rollout_of_a_lora_run_samples_from_the_policy_after_the_last_update(tokenizer, tmp_path):
    """A copy that went stale after an update would give logits of the policy before it: checked at every rollout."""
    ids, mask = batch(tokenizer)
    seen = []

    class CheckedNative(NativeEngine):
        def sample(self, policy, prompts, sampling):
            out = super().sample(policy, prompts, sampling)
            copy = self.weights.copy
            seen.append((logits_of(copy, ids, mask), logits_of(policy, ids, mask)))
            return out

    cfg = small_config(tmp_path, iterations=3)
    cfg.model.lora.enabled, cfg.model.lora.r = True, 4
    cfg.ppo.learning_rate = 3e-2
    parts = build_components(
        cfg,
        policy=tiny_llama(tokenizer),
        tokenizer=tokenizer,
        prompts=PROMPTS,
        reward_functions=[lambda p, c: [len(x) / 10.0 for x in c]],
    )
    parts.sampling_engines["native"] = CheckedNative(cfg, parts.stop_ids, tokenizer.pad_token_id, parts.accelerator)
    PPOTrainer(cfg, components=parts).train()
    assert len(seen) == 3
    for copy_logits, policy_logits in seen:
        assert torch.allclose(copy_logits, policy_logits, atol=1e-5, rtol=1e-5)
    assert (seen[2][1] - seen[0][1]).abs().max() > 1e-3  # the updates moved the policy between the rollouts


def test_a_lora_layer_no_fold_reproduces_leaves_the_sampler_on_the_policy(tokenizer):
    from peft import LoraConfig, get_peft_model

    dora = get_peft_model(
        tiny_llama(tokenizer), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True)
    ).eval()
    weights = SamplingWeights()
    assert weights.model_for(dora) is hf_model(dora) and weights.copy is None and weights.refreshes == 0


def test_the_hf_engine_generates_the_same_tokens_from_the_copy(tokenizer, tmp_path):
    policy = lora_policy(tokenizer)
    ids, mask = batch(tokenizer)
    cfg = small_config(tmp_path)
    stop = torch.tensor([tokenizer.eos_token_id])
    prompts = PromptBatch(ids=ids, mask=mask, token_lists=[r[m].tolist() for r, m in zip(ids, mask)], seeds=[0] * 4)
    engine = HFEngine(cfg, stop, tokenizer.pad_token_id, accelerator=None)
    gen = pure_sampling_config(
        policy, cfg.rollout.temperature, cfg.rollout.max_new_tokens, [tokenizer.eos_token_id], tokenizer.pad_token_id
    )
    torch.manual_seed(3)
    got = engine.sample(
        policy, prompts, Sampling.of(cfg.rollout)
    )  # builds the copy first: that must not draw from the global RNG
    torch.manual_seed(3)
    want = sample_responses(policy, ids, mask, gen, stop, cfg.rollout.max_new_tokens)
    assert engine.weights.copy is not None and engine.weights.refreshes == 1
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_copy_of_a_policy_with_its_adapters_switched_off_is_the_base_model(tokenizer):
    """Evaluation samples the starting point of a LoRA run through the run's engine as the policy with its adapters
    off (`policy.disable_adapter()`): the copy must then compute the base model, and the adapters again after."""
    policy = lora_policy(tokenizer)
    ids, mask = batch(tokenizer)
    weights = SamplingWeights()
    with policy.disable_adapter():
        copy = weights.model_for(policy)
        assert torch.allclose(logits_of(copy, ids, mask), logits_of(tiny_llama(tokenizer), ids, mask), atol=1e-5)
    assert weights.model_for(policy) is copy
    assert torch.allclose(logits_of(copy, ids, mask), logits_of(policy, ids, mask), atol=1e-5, rtol=1e-5)


def test_a_working_copy_holds_every_linear_weight_in_bf16_and_computes_what_autocast_computes(tokenizer):
    """The GPU path (`cpu_working_copy` takes it on CPU): under bf16 autocast a copy of every fp32 linear layer in
    bf16, made once per rollout instead of a cast at every decoding step, gives autocast's own logits; embeddings
    and norms stay the policy's fp32 tensors; an optimizer step reaches the copy at the next rollout."""
    model = tiny_llama(tokenizer)
    ids, mask = batch(tokenizer)
    weights = SamplingWeights(cpu_working_copy=True)
    assert weights.model_for(model) is model  # no autocast: nothing to cast, no copy
    with torch.autocast("cpu", dtype=torch.bfloat16):
        copy = weights.model_for(model)
        assert copy is not model and weights.working
        linear = [m for m in copy.modules() if isinstance(m, nn.Linear)]
        assert linear and all(m.weight.dtype == torch.bfloat16 for m in linear)
        assert copy.model.embed_tokens.weight is model.model.embed_tokens.weight
        assert copy.model.layers[0].input_layernorm.weight is model.model.layers[0].input_layernorm.weight
        assert torch.equal(logits_of(copy, ids, mask), logits_of(model, ids, mask))
        seeds = [response_seed(0, 0, p) for p in range(ids.shape[0])]
        stop = torch.tensor([tokenizer.eos_token_id])
        drawn = [sample_native(m, ids, mask, 1.0, 8, stop, tokenizer.pad_token_id, seeds) for m in (model, copy)]
        assert all(torch.equal(a, b) for a, b in zip(*drawn))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=0.05, fused=True)  # in place, without bumping tensor versions
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(logits_of(copy, ids, mask), logits_of(model, ids, mask)) is False  # stale until refreshed
        assert weights.model_for(model) is copy and weights.refreshes == 2
        assert torch.equal(logits_of(copy, ids, mask), logits_of(model, ids, mask))
