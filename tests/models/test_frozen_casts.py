"""Frozen weights cast to bf16 once (lmppo.models.frozen_casts): the same numbers as autocast's cast at every call, a
new
cast whenever the weight changes, nn.Linear's own path for trainable weights and fp32 calls, and wired into runs."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import PROMPTS, small_config, tiny_llama
from lmppo.config import ModelConfig
from lmppo.models.frozen_casts import FrozenCastLinear, reuse_frozen_casts
from lmppo.models.loading import hf_model, prepare_policy
from lmppo.sampling.native import SamplingWeights
from lmppo.training.assembly import build_components
from lmppo.training.trainer import PPOTrainer


def bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def frozen_layer(weight, bias=None) -> nn.Linear:
    layer = nn.Linear(len(weight[0]), len(weight), bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(weight))
        if bias is not None:
            layer.bias.copy_(torch.tensor(bias))
    layer.requires_grad_(False)
    reuse_frozen_casts(layer)
    return layer


def lora_policy(tokenizer, tied: bool = False) -> nn.Module:
    model = tiny_llama(tokenizer)
    if tied:  # the LM head is the embedding matrix, as in SmolLM2
        model.lm_head.weight = model.model.embed_tokens.weight
    mc = ModelConfig()
    mc.lora.enabled, mc.lora.r, mc.lora.alpha, mc.lora.target_modules = True, 4, 8, ["all-linear"]
    policy = prepare_policy(model, mc)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # PEFT starts B at zero: give the adapters real weights
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return policy


def test_one_cast_is_kept_and_remade_when_the_weight_changes():
    layer = frozen_layer([[1.0, 2.0], [3.0, 4.0]], bias=[0.5, -0.5])
    assert type(layer) is FrozenCastLinear and isinstance(layer, nn.Linear)
    x = torch.tensor([[1.0, 1.0]])
    with bf16():
        first = layer(x)
        kept = layer._frozen_cast[1]
        assert first.dtype == torch.bfloat16 and first.tolist() == [[3.5, 6.5]]  # 1+2+0.5, 3+4-0.5
        layer(x)
        assert layer._frozen_cast[1] is kept and kept.dtype == torch.bfloat16  # not cast again
        with torch.no_grad():
            layer.weight.add_(1.0)  # any in-place write (a checkpoint load, a reference sync) bumps the version
        assert layer(x).tolist() == [[5.5, 8.5]]
        assert layer._frozen_cast[1] is not kept
        layer.load_state_dict({"weight": torch.tensor([[0.0, 1.0], [1.0, 0.0]]), "bias": torch.zeros(2)})
        assert layer(torch.tensor([[2.0, 3.0]])).tolist() == [[3.0, 2.0]]


def test_trainable_weights_and_calls_outside_autocast_take_nn_linears_path():
    layer = frozen_layer([[1.0, 2.0], [3.0, 4.0]])
    x = torch.tensor([[0.1, 0.7]])
    out = layer(x)  # fp32, no autocast: no cast is made
    assert out.dtype == torch.float32 and torch.equal(out, F.linear(x, layer.weight))
    assert "_frozen_cast" not in layer.__dict__
    layer.weight.requires_grad_(True)  # trained: autocast's own cache handles it, and the gradient must reach it
    with bf16():
        layer(x).sum().backward()
    assert "_frozen_cast" not in layer.__dict__
    assert layer.weight.grad.tolist() == [[pytest.approx(0.1, abs=1e-3), pytest.approx(0.7, abs=1e-3)]] * 2


def test_a_cast_made_under_inference_mode_serves_a_later_pass_with_grad():
    layer = frozen_layer([[1.0, -1.0], [0.5, 2.0]])
    with bf16():
        with torch.inference_mode():
            layer(torch.ones(1, 2))
        x = torch.tensor([[1.0, 2.0]], requires_grad=True)
        layer(x).sum().backward()  # the kept cast is saved for backward: it must not be an inference tensor
    assert x.grad.tolist() == [[1.5, 1.0]]


def test_copies_and_pickles_leave_the_cast_behind_and_switching_back_drops_it():
    layer = frozen_layer([[1.0, 2.0], [3.0, 4.0]])
    with bf16():
        layer(torch.ones(1, 2))
    assert "_frozen_cast" in layer.__dict__
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert type(twin) is FrozenCastLinear and "_frozen_cast" not in twin.__dict__
        with bf16():
            assert twin(torch.ones(1, 2)).tolist() == [[3.0, 7.0]]
    assert reuse_frozen_casts(layer, enabled=False) == 1
    assert type(layer) is nn.Linear and "_frozen_cast" not in layer.__dict__


@pytest.mark.parametrize("tied", [False, True])
def test_a_lora_policy_computes_bit_for_bit_what_autocast_computes(tokenizer, tied):
    plain = lora_policy(tokenizer, tied=tied)
    cast_once = copy.deepcopy(plain)
    switched = reuse_frozen_casts(cast_once)
    assert switched == 2 * 7 + 1  # q k v o gate up down of 2 layers (LoRA base layers), and the LM head
    ids = torch.tensor([[5, 9, 14, 3, 22, 7], [11, 4, 4, 30, 2, 8]])
    results = []
    for model in (plain, cast_once):
        model.zero_grad()
        with bf16():
            logits = model(input_ids=ids).logits
            for _ in range(2):  # the second pass reads the kept casts
                logits = model(input_ids=ids).logits
            loss = torch.log_softmax(logits.float(), -1)[..., 0].mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((logits, grads))
    (want, want_grads), (got, got_grads) = results
    assert torch.equal(got, want)
    assert want_grads.keys() == got_grads.keys() and all(torch.equal(got_grads[n], want_grads[n]) for n in want_grads)
    base = hf_model(cast_once)
    q_proj = base.model.layers[0].self_attn.q_proj.base_layer
    assert type(q_proj) is FrozenCastLinear and "_frozen_cast" in q_proj.__dict__  # the kept cast was used
    assert "_frozen_cast" in base.lm_head.__dict__
    if tied:  # the embedding lookup still reads the fp32 matrix
        assert base.model.embed_tokens.weight.dtype == torch.float32
        assert base.lm_head.weight is base.model.embed_tokens.weight


def _bf16_lora_run(tokenizer, output_dir, keep_casts: bool) -> tuple[list[dict], SamplingWeights]:
    cfg = small_config(
        output_dir,
        model__lora__enabled=True,
        model__lora__r=4,
        model__lora__alpha=8,
        model__lora__target_modules=["all-linear"],
    )
    cfg.precision = "bf16"
    model = tiny_llama(tokenizer)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as in SmolLM2
    parts = build_components(
        cfg,
        policy=model,
        tokenizer=tokenizer,
        prompts=PROMPTS,
        reward_functions=[lambda p, c: [len(x) / 10.0 for x in c]],
    )
    trainer = PPOTrainer(cfg, components=parts)
    weights = trainer.sampling_engine().weights
    weights.keep_casts = keep_casts
    return trainer.train(), weights


def test_the_sampling_copy_keeps_the_heads_cast_and_the_run_is_the_same_without_it(tokenizer, tmp_path):
    (kept, kept_weights), (plain, plain_weights) = (
        _bf16_lora_run(tokenizer, tmp_path / str(keep), keep) for keep in (True, False)
    )
    head = kept_weights.copy.lm_head
    assert type(head) is FrozenCastLinear and "_frozen_cast" in head.__dict__  # the sampler used the kept cast
    assert head.weight is hf_model(kept_weights.source).model.embed_tokens.weight  # shared, not copied
    assert kept_weights.refreshes == 2 and type(kept_weights.copy.model.layers[0].mlp.up_proj) is nn.Linear
    assert type(plain_weights.copy.lm_head) is nn.Linear
    assert not any(type(m) is FrozenCastLinear for m in kept_weights.source.modules())  # the policy's passes: as before
    timings = ("time/", "tokens_per_s", "eps")
    keys = [k for k in kept[0] if not k.startswith(timings)]
    assert "objective/kl" in keys and "loss/policy_avg" in keys
    for mine, theirs in zip(kept, plain):
        assert {k: mine[k] for k in keys} == {k: theirs[k] for k in keys}
