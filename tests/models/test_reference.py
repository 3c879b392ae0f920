"""Reference policies against hand-computed parameters, their logprobs, their checkpoint state, and the KL
controller as the trainer runs it."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import PROMPTS, frac_target_reward, tiny_llama
from lmppo.config import Config, ModelConfig
from lmppo.core.logprobs import selective_log_softmax
from lmppo.errors import CheckpointError, ConfigError
from lmppo.models.loading import policy_forward, prepare_policy
from lmppo.models.reference import ReferencePolicy, trained_parameters
from lmppo.sampling.hf import left_pad
from lmppo.training.trainer import PPOTrainer


def lora_policy(tokenizer, seed: int = 0):
    mc = ModelConfig()
    mc.lora.enabled, mc.lora.r = True, 4
    return prepare_policy(tiny_llama(tokenizer, seed=seed), mc)


def batch(tokenizer):
    """(B, P + T) ids and mask of prompts with fixed 3-token 'responses', P, and the (B, T) responses."""
    ids, mask = left_pad([tokenizer.encode(p) for p in PROMPTS[:4]], tokenizer.pad_token_id)
    response = torch.tensor([[5, 17, 2], [40, 41, 42], [7, 7, 7], [100, 3, 2]])
    return (
        torch.cat([ids, response], 1),
        torch.cat([mask, torch.ones_like(response, dtype=torch.bool)], 1),
        ids.shape[1],
        response,
    )


def logprobs_of(model, tokenizer, temperature: float = 0.7):
    ids, mask, P, response = batch(tokenizer)
    with torch.no_grad():
        logits = policy_forward(model, ids, mask, P, temperature).logits
    return selective_log_softmax(logits, response)


def ref_logprobs(reference, policy, tokenizer, temperature: float = 0.7):
    ids, mask, P, response = batch(tokenizer)
    with torch.no_grad():
        return reference.logprobs(policy, ids, mask, P, response, temperature)


def set_all(params, value: float) -> None:
    with torch.no_grad():
        for p in params:
            p.fill_(value)


def snapshot(named) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in named}


# ----------------------------------------------------------------------------- full copy: hand-computed parameters
# A full reference copy computes the same numbers as the policy up to ~5e-7: with requires_grad off, torch's CPU
# kernels may take another (equally exact) path. LoRA references run the policy's own modules and match bit for bit.
def test_frozen_never_moves(tokenizer):
    policy = tiny_llama(tokenizer)
    initial = logprobs_of(copy.deepcopy(policy), tokenizer)
    ref = ReferencePolicy(policy, "frozen")
    for k in range(1, 4):
        set_all(policy.parameters(), float(k))
        assert ref.after_iteration(k, policy) is False
    assert torch.allclose(ref_logprobs(ref, policy, tokenizer), initial, atol=1e-6)


def test_sync_copies_after_iterations_every_2every(tokenizer):
    """every = 2; the policy's parameters all equal k after iteration k. The reference holds the initial weights
    after iteration 1, then 2 after iterations 2 and 3, then 4 after iterations 4 and 5."""
    policy = tiny_llama(tokenizer)
    ref = ReferencePolicy(policy, "sync", every=2)
    initial = snapshot(ref.model.named_parameters())
    expected = {1: None, 2: 2.0, 3: 2.0, 4: 4.0, 5: 4.0}
    for k, value in expected.items():
        set_all(policy.parameters(), float(k))
        assert ref.after_iteration(k, policy) is (k % 2 == 0)
        for name, p in ref.model.named_parameters():
            want = initial[name] if value is None else torch.full_like(p, value)
            assert torch.equal(p, want), (k, name)
    # the synced reference computes exactly what the policy computed at iteration 4
    set_all(policy.parameters(), 4.0)
    at_sync = logprobs_of(policy, tokenizer)
    set_all(policy.parameters(), 5.0)
    assert torch.allclose(ref_logprobs(ref, policy, tokenizer), at_sync, atol=1e-6)


@pytest.mark.parametrize(
    "alpha, every, expected",
    [
        # ref_k = (1 - a) ref_{k-1} + a * k at each update; written as (weight of the initial params, constant)
        # a = .5, every 1: (.5, .5) -> (.25, .25 + 1 = 1.25) -> (.125, .625 + 1.5 = 2.125)
        (0.5, 1, {1: (0.5, 0.5), 2: (0.25, 1.25), 3: (0.125, 2.125)}),
        # a = .25, every 2: iteration 1 no update; 2: (.75, .5); 3: same; 4: (.5625, .375 + 1 = 1.375)
        (0.25, 2, {1: (1.0, 0.0), 2: (0.75, 0.5), 3: (0.75, 0.5), 4: (0.5625, 1.375)}),
    ],
)
def test_ema_mixes_by_hand(tokenizer, alpha, every, expected):
    policy = tiny_llama(tokenizer)
    ref = ReferencePolicy(policy, "ema", every=every, ema_alpha=alpha)
    initial = snapshot(ref.model.named_parameters())
    for k, (w0, const) in expected.items():
        set_all(policy.parameters(), float(k))
        ref.after_iteration(k, policy)
        for name, p in ref.model.named_parameters():
            assert torch.allclose(p, w0 * initial[name] + const, atol=1e-6), (k, name)


# ----------------------------------------------------------------------------- LoRA: no second copy of the weights
def test_lora_frozen_is_the_base_model_with_adapters_off(tokenizer):
    policy = lora_policy(tokenizer)
    base = tiny_llama(tokenizer)  # the same initial weights, never wrapped
    ref = ReferencePolicy(policy, "frozen")
    assert ref.adapter_off and ref.model is None and not ref.adapter  # holds no tensor at all
    assert ref.state_dict() == {"mode": "frozen"}
    for name, p in trained_parameters(policy).items():  # the policy moves away from the base
        with torch.no_grad():
            p.normal_(0, 0.5)
    moved = snapshot(trained_parameters(policy).items())
    assert not torch.allclose(logprobs_of(policy, tokenizer), logprobs_of(base, tokenizer))
    assert torch.allclose(ref_logprobs(ref, policy, tokenizer), logprobs_of(base, tokenizer), atol=1e-6)
    for name, p in trained_parameters(policy).items():  # switching the adapters off left them as they were
        assert torch.equal(p, moved[name])


def test_lora_sync_and_ema_keep_a_reference_adapter(tokenizer):
    """sync every 2: the reference adapter holds the policy's adapter from iterations 2, 4; ema (a = .5, every 1):
    the factors mix as ref_k = .5 ref_{k-1} + .5 k. The reference is base + reference adapter, and computing it
    leaves the policy's own adapter bit for bit as it was."""
    for mode, every, alpha, expected in (
        ("sync", 2, 0.1, {1: None, 2: (0.0, 2.0), 3: (0.0, 2.0)}),
        ("ema", 1, 0.5, {1: (0.5, 0.5), 2: (0.25, 1.25)}),
    ):
        policy = lora_policy(tokenizer)
        ref = ReferencePolicy(policy, mode, every=every, ema_alpha=alpha)
        assert ref.model is None and set(ref.adapter) == set(trained_parameters(policy))
        assert all(".lora_" in name for name in ref.adapter)  # only adapter tensors: no copy of the base
        initial = {n: t.clone() for n, t in ref.adapter.items()}
        for k, mix in expected.items():
            set_all(trained_parameters(policy).values(), float(k) / 10)
            ref.after_iteration(k, policy)
            for name, t in ref.adapter.items():
                want = initial[name] if mix is None else mix[0] * initial[name] + mix[1] / 10
                assert torch.allclose(t, want, atol=1e-6), (mode, k, name)
        # reference logprobs = a policy whose adapter holds the reference adapter's values
        twin = copy.deepcopy(policy)
        with torch.no_grad():
            for name, p in trained_parameters(twin).items():
                p.copy_(ref.adapter[name])
        before = snapshot(trained_parameters(policy).items())
        assert torch.allclose(ref_logprobs(ref, policy, tokenizer), logprobs_of(twin, tokenizer), atol=1e-6)
        for name, p in trained_parameters(policy).items():
            assert torch.equal(p, before[name])
        assert not torch.allclose(logprobs_of(policy, tokenizer), logprobs_of(twin, tokenizer))


def test_lora_frozen_with_an_already_trained_adapter_keeps_the_initial_policy(tokenizer):
    """An adapter that is not zero at the start (after SFT, say): switching it off would not give the initial
    policy, so the reference keeps a copy of the initial adapter instead."""
    policy = lora_policy(tokenizer)
    with torch.no_grad():
        for p in trained_parameters(policy).values():
            p.normal_(0, 0.3)
    initial = logprobs_of(copy.deepcopy(policy), tokenizer)
    ref = ReferencePolicy(policy, "frozen")
    assert not ref.adapter_off and ref.adapter
    set_all(trained_parameters(policy).values(), 0.05)
    assert torch.allclose(ref_logprobs(ref, policy, tokenizer), initial, atol=1e-6)


# ----------------------------------------------------------------------------- checkpoint state
@pytest.mark.parametrize("lora, mode", [(False, "sync"), (False, "ema"), (True, "sync"), (True, "ema")])
def test_state_dict_round_trip(tokenizer, lora, mode):
    make = (lambda seed: lora_policy(tokenizer, seed)) if lora else (lambda seed: tiny_llama(tokenizer, seed=seed))
    policy = make(0)
    ref = ReferencePolicy(policy, mode, every=1, ema_alpha=0.3)
    set_all(trained_parameters(policy).values(), 0.02)
    ref.after_iteration(1, policy)
    state = ref.state_dict()
    assert state["mode"] == mode and state["weights"]
    assert all(t.device.type == "cpu" for t in state["weights"].values())
    expected = ref_logprobs(ref, policy, tokenizer)

    resumed_policy = make(0)  # resume: the initial policy again, then the trained weights, then the reference
    with torch.no_grad():
        for name, p in trained_parameters(resumed_policy).items():
            p.copy_(trained_parameters(policy)[name])
    resumed = ReferencePolicy(resumed_policy, mode, every=1, ema_alpha=0.3)
    resumed.load_state_dict(state)
    assert torch.equal(ref_logprobs(resumed, resumed_policy, tokenizer), expected)  # same kernels: exact

    with pytest.raises(CheckpointError, match="reference.mode"):
        ReferencePolicy(make(0), "frozen" if mode == "sync" else "sync").load_state_dict(state)


def test_frozen_full_copy_is_fingerprinted_not_stored(tokenizer):
    ref = ReferencePolicy(tiny_llama(tokenizer), "frozen")
    state = ref.state_dict()
    assert set(state) == {"mode", "fingerprint"}
    ReferencePolicy(tiny_llama(tokenizer), "frozen").load_state_dict(state)  # same initial policy: fine
    with pytest.raises(CheckpointError, match="frozen reference rebuilt on resume differs"):
        ReferencePolicy(tiny_llama(tokenizer, seed=1), "frozen").load_state_dict(state)


def test_unknown_mode_is_a_config_error(tokenizer):
    with pytest.raises(ConfigError, match="reference.mode"):
        ReferencePolicy(tiny_llama(tokenizer), "copy")


# ----------------------------------------------------------------------------- through the trainer
def run(tokenizer, tmp_path, iterations: int, **overrides) -> tuple[PPOTrainer, list[dict]]:
    frac_target = frac_target_reward(tokenizer)

    cfg = Config()
    cfg.precision = "fp32"  # the same numbers on every CPU (`auto` picks bf16 where it is native)
    cfg.output_dir, cfg.overwrite, cfg.log.trackers, cfg.log.sample_every = str(tmp_path), True, [], 0
    cfg.total_episodes, cfg.rollout.batch_size, cfg.rollout.max_new_tokens = 8 * iterations, 8, 6
    cfg.rollout.temperature, cfg.rollout.stop_token = 1.0, "none"
    cfg.ppo.learning_rate, cfg.ppo.num_epochs, cfg.ppo.micro_batch_size = 1e-2, 2, 8
    cfg.ppo.lr_schedule = "constant"
    cfg.kl.controller, cfg.kl.coef = "fixed", 0.05
    for dotted, value in overrides.items():
        section, name = dotted.split("__")
        setattr(getattr(cfg, section), name, value)
    trainer = PPOTrainer(
        cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=list(PROMPTS), reward_functions=[frac_target]
    )
    return trainer, trainer.train()


@pytest.mark.parametrize("lora", [False, True])
def test_trainer_sync_schedule_shows_in_the_kl(tokenizer, tmp_path, lora):
    """sync every 2: at the rollout of iterations 1 and 3 the reference equals the policy, so the KL is 0; at
    iterations 2 and 4 the policy has had one update since, so it is not."""
    _, history = run(tokenizer, tmp_path, 4, reference__mode="sync", reference__every=2, model__lora=_lora(lora))
    kls = [abs(m["objective/kl"]) for m in history]
    assert kls[0] < 1e-5 and kls[2] < 1e-5 and kls[1] > 1e-3 and kls[3] > 1e-3, kls
    if lora:  # base + reference adapter runs the very same modules: bit for bit
        assert kls[0] == kls[2] == 0.0
    assert [m.get("reference/updated", 0.0) for m in history] == [0.0, 1.0, 0.0, 1.0]


def test_trainer_ema_with_alpha_one_is_sync_every_iteration(tokenizer, tmp_path):
    _, history = run(tokenizer, tmp_path, 3, reference__mode="ema", reference__every=1, reference__ema_alpha=1.0)
    assert all(abs(m["objective/kl"]) < 1e-5 for m in history)


def test_trainer_adaptive_kl_coefficient_follows_the_formula(tokenizer, tmp_path):
    """Ziegler et al.: beta_{i+1} = beta_i * (1 + clip(KL_i / target - 1, -0.2, 0.2) * B / horizon), with KL_i
    the logged mean KL per response of iteration i and B = 8 episodes. Iteration 1 has KL = 0 exactly (policy ==
    reference), so its error is clipped to -0.2: beta_2 = 0.1 * (1 - 0.2 * 8 / 16) = 0.09 (its KL is 0 up to
    float noise, see above)."""
    target, horizon = 0.05, 16
    _, history = run(
        tokenizer, tmp_path, 5, kl__controller="adaptive", kl__coef=0.1, kl__target=target, kl__horizon=horizon
    )
    coefs = [m["objective/kl_coef"] for m in history]
    assert coefs[0] == 0.1 and coefs[1] == pytest.approx(0.09, rel=1e-6)
    for i in range(len(history) - 1):
        error = min(max(history[i]["objective/kl"] / target - 1.0, -0.2), 0.2)
        assert coefs[i + 1] == pytest.approx(coefs[i] * (1 + error * 8 / horizon), rel=1e-12), i
    assert len(set(coefs)) == len(coefs)  # it moved every iteration


def _lora(enabled: bool):
    from lmppo.config import LoraConfig

    return LoraConfig(enabled=enabled, r=4)
