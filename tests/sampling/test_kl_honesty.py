"""Honest sampling: the logprobs lmppo uses for the ratio and the KL describe the distribution tokens were sampled from.

Statistical tests here use fixed seeds (deterministic), with thresholds chosen so that a correct implementation
would fail them with probability < 1e-3 under a fresh seed, and each comes with a *power check*: the same
statistic on a deliberately wrong sampler (wrong temperature, top-k) must fail it by a wide margin.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

from conftest import PROMPTS, tiny_llama
from lmppo.config import Config
from lmppo.errors import ConfigError, LmppoError
from lmppo.sampling.hf import (
    DISTORTING_SETTINGS,
    check_generation_kwargs,
    left_pad,
    pure_sampling_config,
    sample_responses,
    verify_pure_sampling,
)
from lmppo.sampling.native import sample_native
from lmppo.sampling.settings import Sampling
from lmppo.training.trainer import PPOTrainer, ScoredRollout

T = 0.7  # the default rollout.temperature


def peaky_llama(tokenizer, seed: int = 0):
    """A tiny Llama whose next-token distributions are far from uniform (entropy ~3.4 nats of log 400 = 6),
    so that the temperature, truncation and penalties all visibly change them."""
    model = tiny_llama(tokenizer, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def add_stop_bias(model, tokenizer, value: float):
    """Give the LM head a bias of `value` on the stop token (and 0 elsewhere): the stop token becomes likely."""
    head = model.lm_head
    head.bias = torch.nn.Parameter(torch.zeros(head.out_features), requires_grad=False)
    with torch.no_grad():
        head.bias[tokenizer.eos_token_id] = value
    return model


def polluted(model):
    """The model's own generation_config carries the settings checkpoints often ship; transformers 5 merges
    them into the config passed to generate unless lmppo neutralises them."""
    model.generation_config = GenerationConfig(
        do_sample=False,
        temperature=0.3,
        top_k=5,
        top_p=0.5,
        repetition_penalty=1.5,
        min_new_tokens=1,
        no_repeat_ngram_size=1,
    )
    return model


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson chi-square goodness of fit of `counts` to `probs`; categories with expected count < 5 are pooled
    into one bin. Returns (p-value, total variation distance). p-value from the chi-square survival function,
    Q(df / 2, stat / 2) (regularised upper incomplete gamma)."""
    counts, probs = counts.double(), probs.double()
    n = counts.sum()
    expected = n * probs
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(len(obs) - 1), dtype=torch.float64)
    pvalue = torch.special.gammaincc(df / 2, stat / 2).item()
    tv = 0.5 * (counts / n - probs).abs().sum().item()
    return pvalue, tv


def one_step_counts(model, tokenizer, gen, n: int = 4000, seed: int = 0) -> torch.Tensor:
    """Counts of the first response token over n samples from PROMPTS[0]: through transformers' generate with
    `gen`, or through lmppo's native sampler when `gen` is None."""
    ids, mask = left_pad([tokenizer.encode(PROMPTS[0])] * n, tokenizer.pad_token_id)
    stop = torch.tensor([tokenizer.eos_token_id])
    torch.manual_seed(seed)
    if gen is None:
        response = sample_native(model, ids, mask, T, 1, stop, tokenizer.pad_token_id, range(seed, seed + n))[0]
    else:
        response = sample_responses(model, ids, mask, gen, stop, 1)[0]
    return torch.bincount(response[:, 0], minlength=len(tokenizer))


@torch.no_grad()
def next_token_probs(model, tokenizer, temperature: float) -> torch.Tensor:
    ids = torch.tensor([tokenizer.encode(PROMPTS[0])])
    return torch.softmax(model(ids).logits[0, -1].double() / temperature, -1)


# ----------------------------------------------------------------------------- the sampled distribution
@pytest.mark.parametrize("backend", ["hf", "native"])
def test_samplers_draw_from_softmax_logits_over_temperature(tokenizer, backend):
    """4000 one-token samples from one prompt match softmax(logits / T) (chi-square p > 1e-3; under honest
    sampling that fails with probability 1e-3), even though the model's generation_config asks for top_k=5,
    top_p=0.5, a repetition penalty and greedy decoding. Power: the same counts against T = 1, and counts
    sampled with top_k = 5, are rejected at p < 1e-6."""
    model = polluted(peaky_llama(tokenizer))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    gen = pure_sampling_config(model, T, 1, [eos], pad) if backend == "hf" else None
    counts = one_step_counts(model, tokenizer, gen)
    probs = next_token_probs(model, tokenizer, T)
    pvalue, tv = chi_square_pvalue(counts, probs)
    assert pvalue > 1e-3, (pvalue, tv)
    # the expected TV of 4000 honest samples is about sum_i sqrt(p_i (1 - p_i) / (2 pi n)) (~0.1 here)
    expected_tv = (probs * (1 - probs) / (2 * math.pi * counts.sum())).sqrt().sum().item()
    assert tv < 1.5 * expected_tv, (tv, expected_tv)
    # the model's own generation defaults are untouched (the saved model keeps them)
    assert model.generation_config.top_k == 5 and model.generation_config.repetition_penalty == 1.5

    # power: wrong temperature, and a truncated sampler, are both rejected by the same test
    assert chi_square_pvalue(counts, next_token_probs(model, tokenizer, 1.0))[0] < 1e-6
    top_k = pure_sampling_config(model, T, 1, [eos], pad, {"top_k": 5})
    assert chi_square_pvalue(one_step_counts(model, tokenizer, top_k), probs)[0] < 1e-6


@pytest.mark.parametrize("lora", [False, True])
def test_logits_processors_hold_only_the_temperature_warper(tokenizer, monkeypatch, lora):
    """What transformers actually builds inside generate, with a polluted model generation_config."""
    from lmppo.config import ModelConfig
    from lmppo.models.loading import prepare_policy

    built = []
    original = GenerationMixin._get_logits_processor

    def spy(self, *args, **kwargs):
        processors = original(self, *args, **kwargs)
        built.append([type(p).__name__ for p in processors])
        return processors

    monkeypatch.setattr(GenerationMixin, "_get_logits_processor", spy)
    mc = ModelConfig()
    mc.lora.enabled = lora
    model = prepare_policy(polluted(peaky_llama(tokenizer)), mc)
    gen = pure_sampling_config(model, T, 3, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    ids, mask = left_pad([tokenizer.encode(p) for p in PROMPTS[:3]], tokenizer.pad_token_id)
    sample_responses(model, ids, mask, gen, torch.tensor([tokenizer.eos_token_id]), 3)
    assert built and all(names == ["TemperatureLogitsWarper"] for names in built), built


@pytest.mark.parametrize(
    "setting",
    [
        {"top_k": 5},
        {"top_p": 0.5},
        {"repetition_penalty": 1.3},
        {"min_new_tokens": 2},
        {"suppress_tokens": [3]},
        {"top_h": 0.5},
    ],
)
def test_probe_detects_every_distorting_setting(tokenizer, setting):
    model = peaky_llama(tokenizer)
    gen = pure_sampling_config(model, T, 4, [tokenizer.eos_token_id], tokenizer.pad_token_id, setting)
    with pytest.raises(LmppoError, match="does not sample from softmax"):
        verify_pure_sampling(model, gen)
    rng = torch.get_rng_state()
    verify_pure_sampling(model, pure_sampling_config(model, T, 4, [tokenizer.eos_token_id], 0))
    assert torch.equal(rng, torch.get_rng_state())  # the probe leaves the global RNG alone


def test_check_generation_kwargs():
    assert check_generation_kwargs({"top_k": 0, "top_p": 1.0, "use_cache": True}, False) == []
    assert check_generation_kwargs({"top_k": 5, "min_new_tokens": 3}, True) == ["top_k", "min_new_tokens"]
    with pytest.raises(ConfigError, match="rollout.generation_kwargs.temperature"):
        check_generation_kwargs({"temperature": 0.5}, False)
    with pytest.raises(ConfigError, match="rollout.generation_kwargs.dola_layers.*not a generation setting"):
        check_generation_kwargs({"dola_layers": "high"}, True)
    assert all(v is None or not isinstance(v, bool) or v is False for v in DISTORTING_SETTINGS.values())


# ----------------------------------------------------------------------------- the KL estimate
def trainer_for(tokenizer, policy, tmp_path, **overrides) -> PPOTrainer:
    cfg = Config()
    cfg.precision = "fp32"  # the same numbers on every CPU (`auto` picks bf16 where it is native)
    cfg.output_dir, cfg.overwrite = str(tmp_path / "run"), True
    cfg.log.trackers, cfg.log.sample_every = [], 0
    cfg.rollout.batch_size, cfg.total_episodes, cfg.rollout.max_new_tokens = 16, 16, 8
    cfg.ppo.micro_batch_size, cfg.ppo.num_epochs = 8, 1
    for dotted, value in overrides.items():
        obj = cfg
        *path, last = dotted.split("__")
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, last, value)
    return PPOTrainer(
        cfg,
        policy=policy,
        tokenizer=tokenizer,
        prompts=list(PROMPTS),
        reward_functions=[lambda prompts, completions: [0.0] * len(completions)],
    )


@torch.no_grad()
def exact_two_token_kl(policy, reference, prompt: list[int], temperature: float, eos: int) -> float:
    """KL(pi || pi_ref) over responses of at most two tokens that stop at `eos`, by enumeration:
    KL = KL(first token) + sum_{v != eos} pi(v) KL(second token | v)."""
    x = torch.tensor([prompt])
    lp1 = torch.log_softmax(policy(x).logits[0, -1].double() / temperature, -1)
    lr1 = torch.log_softmax(reference(x).logits[0, -1].double() / temperature, -1)
    V = lp1.shape[0]
    ext = torch.cat([x.repeat(V, 1), torch.arange(V)[:, None]], 1)
    lp2 = torch.log_softmax(policy(ext).logits[:, -1].double() / temperature, -1)
    lr2 = torch.log_softmax(reference(ext).logits[:, -1].double() / temperature, -1)
    p1 = lp1.exp()
    continues = p1.clone()
    continues[eos] = 0.0
    return ((p1 * (lp1 - lr1)).sum() + (continues * (lp2.exp() * (lp2 - lr2)).sum(-1)).sum()).item()


def k1_vs_exact(trainer) -> tuple[float, float, float, float]:
    """Sample one rollout through the trainer; per response: k1 summed over tokens (the trainer's own KL) minus
    the exact KL of its prompt. Returns (mean k1, mean exact KL, mean difference, standard error)."""
    rollout = trainer.collect_rollout()
    zeros = torch.zeros_like(rollout.logprobs)
    scored = ScoredRollout(
        token_scores=zeros,
        raw_scores=zeros[:, 0],
        per_source={},
        valid=torch.ones(rollout.batch_size, dtype=torch.bool),
    )
    k1 = trainer.token_rewards(rollout, scored).kl.sum(1).double()  # (B,) per-response KL estimate
    exact_by_prompt: dict[tuple, float] = {}
    exact = []
    for ids, mask in zip(rollout.prompt_ids, rollout.prompt_mask):
        key = tuple(ids[mask].tolist())
        if key not in exact_by_prompt:
            exact_by_prompt[key] = exact_two_token_kl(
                trainer.policy,
                trainer.reference.model,
                list(key),
                trainer.config.rollout.temperature,
                trainer.tokenizer.eos_token_id,
            )
        exact.append(exact_by_prompt[key])
    diff = k1 - torch.tensor(exact, dtype=torch.float64)
    terminated = rollout.terminated.float().mean().item()
    assert 0.05 < terminated < 0.95, terminated  # both the stop-token path and the length limit are exercised
    return k1.mean().item(), sum(exact) / len(exact), diff.mean().item(), (diff.std() / len(diff) ** 0.5).item()


@pytest.fixture(scope="module")
def drifted_trainer(tokenizer, tmp_path_factory):
    """A trainer whose policy is a perturbed copy of its (frozen) reference; batches of 4096 responses of at most
    two tokens, default sampling settings (native backend, temperature 0.7, stop at eos)."""
    base = peaky_llama(tokenizer)
    add_stop_bias(base, tokenizer, 6.0)  # about a quarter of the responses stop after one token
    trainer = trainer_for(
        tokenizer,
        base,
        tmp_path_factory.mktemp("k1"),
        rollout__batch_size=4096,
        total_episodes=4096,
        rollout__max_new_tokens=2,
        rollout__forward_batch_size=1024,
    )
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in trainer.policy.parameters():  # the reference keeps the unperturbed weights
            p.add_(torch.randn(p.shape, generator=g) * 0.15 * p.abs().mean())
    return trainer


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_k1_is_unbiased_with_default_sampling(drifted_trainer, backend):
    """Statistic: z = mean_i(k1_i - KL_exact(prompt_i)) / standard error over 4096 responses, where k1_i is the
    trainer's own per-response KL (summed over tokens) and KL_exact is enumerated over all responses. The terms
    are independent with mean 0 when the sampled distribution is the measured one, so z ~ N(0, 1). Test: |z| < 4
    (false alarm probability 6e-5). This implies the KL is not negative: mean k1 > KL_exact - 4 SE > 0."""
    trainer = drifted_trainer
    trainer.config.rollout.backend = backend
    torch.manual_seed(0)
    mean_k1, mean_exact, diff, se = k1_vs_exact(trainer)
    assert mean_exact > 20 * se  # the KL is large enough for the test to mean something (0.36 nats here)
    assert abs(diff) < 4 * se, (mean_k1, mean_exact, diff, se)
    assert mean_k1 - 3 * se > 0


@pytest.mark.parametrize(
    "temperature, setting, z_min", [(1.0, {}, -1e9), (T, {"top_k": 3}, 6.0)], ids=["temperature-1", "top_k-3"]
)
def test_k1_test_detects_a_sampler_that_is_not_the_measured_one(
    drifted_trainer, tokenizer, temperature, setting, z_min
):
    """Power of the test above: sampling at temperature 1 while measuring at 0.7 moves z to about -8, and top_k = 3
    to about +11. (top_k biases k1 *upwards* here: it keeps the policy's own top tokens, where pi > pi_ref.)"""
    trainer = drifted_trainer
    trainer.config.rollout.backend = "hf"
    engine = trainer.sampling_engine("hf")
    saved = engine.gen_config, engine.gen_sampling
    engine.gen_config = pure_sampling_config(
        trainer.policy, temperature, 2, [tokenizer.eos_token_id], tokenizer.pad_token_id, setting
    )
    engine.gen_sampling = Sampling.of(trainer.config.rollout)  # the run's settings: this config serves its calls
    try:
        torch.manual_seed(0)
        _, _, diff, se = k1_vs_exact(trainer)
    finally:
        engine.gen_config, engine.gen_sampling = saved
    assert abs(diff) > 6 * se and diff / se > z_min, (diff, se)


# ----------------------------------------------------------------------------- refusal and opt-in
def test_top_k_is_refused_with_the_reason(tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="rollout.generation_kwargs"):  # the native sampler takes none at all
        trainer_for(tokenizer, tiny_llama(tokenizer), tmp_path, rollout__generation_kwargs={"top_k": 5})
    with pytest.raises(ConfigError) as info:
        trainer_for(
            tokenizer, tiny_llama(tokenizer), tmp_path, rollout__generation_kwargs={"top_k": 5}, rollout__backend="hf"
        )
    err = info.value
    assert err.field == "rollout.generation_kwargs" and err.value == {"top_k": 5}
    for words in ("top_k", "KL", "negative", "allow_distorting_sampling"):
        assert words in str(err)


def test_opt_in_warns_once_marks_metrics_and_the_negative_kl_guard_fires(tokenizer, tmp_path):
    """min_new_tokens = max_new_tokens forbids the stop token. A policy that has drifted towards the stop token
    (here: +6 on its stop-token logit) then has every *sampled* token less likely than under the reference,
    so k1 is negative although the true KL is positive; the guard says so. (top_k on this tiny model does not do
    it: it samples from the policy's own top tokens, where pi > pi_ref, and biases k1 upwards instead.)"""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = trainer_for(
            tokenizer,
            tiny_llama(tokenizer),
            tmp_path,
            total_episodes=32,
            rollout__generation_kwargs={"min_new_tokens": 8},
            rollout__backend="hf",
            rollout__allow_distorting_sampling=True,
        )
    assert len([w for w in caught if "bend the sampled distribution" in str(w.message)]) == 1
    add_stop_bias(trainer.policy, tokenizer, 6.0)  # the policy drifts; the reference (a copy) does not
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = trainer.train()
    assert not [w for w in caught if "bend the sampled distribution" in str(w.message)]  # only once
    guard = [str(w.message) for w in caught if "mean KL per response" in str(w.message)]
    assert len(guard) == len(history) == 2
    assert "kl.warn_below" in guard[0] and "min_new_tokens" in guard[0]
    for m in history:
        assert m["rollout/distorting_sampling"] == 1.0 and m["objective/kl"] < -0.5
        assert m["response/length_mean"] == 8.0

    # the same drifted policy with honest sampling: the stop token is sampled, the KL is positive, no warning
    honest = trainer_for(
        tokenizer, tiny_llama(tokenizer), tmp_path / "honest", total_episodes=16, rollout__backend="hf"
    )
    add_stop_bias(honest.policy, tokenizer, 6.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (m,) = honest.train()
    assert m["objective/kl"] > 0 and "rollout/distorting_sampling" not in m
    assert not [w for w in caught if "mean KL per response" in str(w.message)]
