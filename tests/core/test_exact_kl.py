"""`kl.estimator: exact`: the KL over the whole vocabulary, its split between rewards and loss, and the trainer."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from conftest import PROMPTS, small_config, tiny_llama
from lmppo.config import Config
from lmppo.core.kl import exact_kl, kl_k1, next_state_kl
from lmppo.core.masking import masked_sum
from lmppo.errors import ConfigError
from lmppo.registry import KL_ESTIMATORS
from lmppo.training.trainer import PPOTrainer


def test_exact_kl_hand_worked():
    # p = (1/2, 1/2), q = (3/4, 1/4): KL = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3) = 0.1438410362
    logits = torch.tensor([[0.0, 0.0]])
    ref = torch.tensor([[math.log(3.0), 0.0]])
    assert exact_kl(logits, ref).item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    assert exact_kl(logits, ref).item() == pytest.approx(0.1438410362, rel=1e-6)
    # a shift of either side's logits changes nothing; equal distributions give 0
    assert exact_kl(logits + 5.0, ref - 2.0).item() == pytest.approx(0.1438410362, rel=1e-6)
    assert exact_kl(ref, ref).item() == 0.0


def test_exact_kl_is_the_expectation_of_k1_over_the_token():
    g = torch.Generator().manual_seed(0)
    logits, ref = torch.randn(2, 3, 7, generator=g), torch.randn(2, 3, 7, generator=g)
    logp, logq = logits.log_softmax(-1), ref.log_softmax(-1)
    expected = sum(logp[..., v].exp() * kl_k1(logp[..., v], logq[..., v]) for v in range(7))
    assert torch.allclose(exact_kl(logits, ref), expected, atol=1e-6)
    assert exact_kl(logits.bfloat16(), ref.bfloat16()).dtype == torch.float32  # computed in fp32
    assert torch.allclose(exact_kl(logits, ref, chunk_size=4), expected, atol=1e-6)  # rows in chunks: same values


def test_next_state_kl_hand_worked():
    kl = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 9.0, 9.0], [6.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    # token t carries the KL of state t + 1 when token t + 1 is real; the last real token carries nothing
    assert next_state_kl(kl, mask).tolist() == [[2.0, 3.0, 0.0, 0.0], [5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


def test_exact_split_gives_the_exact_gradient_of_the_response_kl():
    """Two tokens from a vocabulary of 3, every response enumerated: the policy gradient of the rewards (the next
    state's KL on each token) plus the gradient of the loss term (each state's own KL) equals autograd's gradient of
    KL(pi(response) || pi_ref(response)). k1 in the rewards has the same expectation; `exact` differs only in noise."""
    g = torch.Generator().manual_seed(1)
    first = torch.randn(3, generator=g).requires_grad_()  # logits of token 0
    second = torch.randn(3, 3, generator=g).requires_grad_()  # logits of token 1 given token 0
    ref_first, ref_second = torch.randn(3, generator=g), torch.randn(3, 3, generator=g)

    def response_kl():
        lp0, lq0 = first.log_softmax(-1), ref_first.log_softmax(-1)
        lp1, lq1 = second.log_softmax(-1), ref_second.log_softmax(-1)
        return sum(
            lp0[a].exp() * lp1[a, b].exp() * (lp0[a] - lq0[a] + lp1[a, b] - lq1[a, b])
            for a, b in itertools.product(range(3), range(3))
        )

    exact_grads = torch.autograd.grad(response_kl(), [first, second])

    surrogate = 0.0
    mask = torch.ones(1, 2, dtype=torch.bool)
    for a, b in itertools.product(range(3), range(3)):
        lp0, lp1 = first.log_softmax(-1)[a], second[a].log_softmax(-1)[b]
        prob = (lp0 + lp1).exp().detach()
        state_kl = torch.stack([exact_kl(first, ref_first), exact_kl(second[a], ref_second[a])])[None]  # (1, 2)
        penalty = next_state_kl(state_kl.detach(), mask)[0]  # the rewards' part, a constant in the policy gradient
        returns = penalty.flip(0).cumsum(0).flip(0)  # reward-to-go, gamma 1
        surrogate = surrogate + prob * (returns[0] * lp0 + returns[1] * lp1 + state_kl.sum())  # + the loss term
    split_grads = torch.autograd.grad(surrogate, [first, second])
    for exact, split in zip(exact_grads, split_grads):
        assert torch.allclose(exact, split, atol=1e-6)
    assert exact_grads[0].abs().sum() > 1e-3 and exact_grads[1].abs().sum() > 1e-3


def test_exact_needs_a_placement_it_can_split():
    cfg = Config()
    cfg.kl.estimator, cfg.kl.placement = "exact", "both"
    with pytest.raises(ConfigError, match="kl.placement"):
        cfg.validate()
    with pytest.raises(ConfigError, match="`exact`"):
        cfg.kl.estimator = "k4"  # the registry's estimators and `exact`, refused as it is set


def _length_reward(prompts, completions):
    return [len(c) / 20.0 for c in completions]


def _trainer(tmp_path, tokenizer, name, **fields):
    fields = {"kl__controller": "fixed", "kl__coef": 0.1, **fields}
    cfg = small_config(tmp_path / name, iterations=3, batch=8, ppo__num_epochs=4, ppo__learning_rate=3e-3, **fields)
    return PPOTrainer(
        cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=PROMPTS, reward_functions=[_length_reward]
    )


def test_exact_rollout_rewards_and_loss(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, "exact", kl__estimator="exact")
    history = trainer.train()
    rollout = trainer.collect_rollout()  # the policy has moved: the reference differs from it now
    mask = rollout.response_mask
    # the rollout's KL is the KL over the vocabulary of the policy and the reference on the same responses
    with torch.no_grad():
        policy_logits = trainer.updater.rollout_forward(
            rollout.input_ids, rollout.attention_mask, rollout.prompt_ids.shape[1], keep_graph=False
        ).logits
        ref_logits = trainer.reference.logits(
            trainer.policy, rollout.input_ids, rollout.attention_mask, rollout.prompt_ids.shape[1], 1.0
        )
    want = torch.where(mask, exact_kl(policy_logits, ref_logits), torch.zeros(()))
    assert torch.allclose(rollout.full_logits_kl, want, atol=1e-5) and rollout.full_logits_kl[mask].min() >= 0
    assert rollout.full_logits_kl.sum() > 0
    # the rewards carry beta times the next state's KL; objective/kl is the sum over the states
    scored = trainer.score(rollout)
    rewards = trainer.token_rewards(rollout, scored)
    assert torch.allclose(
        rewards.rewards,
        torch.where(mask, scored.token_scores, torch.zeros(())) - 0.1 * next_state_kl(rollout.full_logits_kl, mask),
        atol=1e-6,
    )
    assert torch.equal(rewards.kl, rollout.full_logits_kl)
    # every iteration logged the loss term; the first batch was sampled from the reference itself
    assert history[0]["objective/kl"] == 0.0 and history[-1]["objective/kl"] > 0.0
    assert all(m["loss/kl_avg"] >= 0.0 for m in history) and history[-1]["loss/kl_avg"] > 0.0
    for m in history:  # TRL's meaning kept: the non-score reward is -beta times the KL per response
        assert m["objective/non_score_reward"] == pytest.approx(-0.1 * m["objective/kl"], rel=1e-5, abs=1e-12)


def test_exact_changes_the_run_and_its_loss_term_acts(tmp_path, tokenizer):
    k1 = _trainer(tmp_path, tokenizer, "k1").train()
    exact = _trainer(tmp_path, tokenizer, "exact", kl__estimator="exact").train()
    loss_only = _trainer(tmp_path, tokenizer, "loss", kl__estimator="exact", kl__placement="loss").train()
    assert "loss/kl_avg" not in k1[0]
    # the same first batch (policy = reference, KL 0 everywhere: the same first update with exact), then they part
    assert k1[0]["objective/scores"] == exact[0]["objective/scores"] == loss_only[0]["objective/scores"]
    assert exact[1]["objective/kl"] == loss_only[1]["objective/kl"] > 0.0
    assert exact[2]["objective/kl"] != loss_only[2]["objective/kl"]  # the rewards' part acted in the second update
    assert k1[-1]["objective/kl"] != exact[-1]["objective/kl"]
    assert loss_only[-1]["objective/kl_coef"] == 0.0 and loss_only[-1]["loss/kl_avg"] > 0.0  # placement loss
    assert [m["loss/kl_coef"] for m in loss_only] == [0.1] * 3  # the loss term's beta, which objective/kl_coef is not
    assert "loss/kl_coef" not in k1[0]  # no KL term in the loss
    # a larger beta pulls harder through the loss term alone
    strong = _trainer(tmp_path, tokenizer, "strong", kl__estimator="exact", kl__placement="loss", kl__coef=50.0).train()
    assert strong[-1]["loss/kl_avg"] < loss_only[-1]["loss/kl_avg"]


def test_exact_and_k1_agree_on_the_sampled_distribution(tmp_path, tokenizer):
    """Sampling, k1 and the exact KL all use the logits at the sampling temperature: over many responses the mean
    k1 sum and the mean exact sum agree (within 4 standard errors of their paired difference)."""
    trainer = _trainer(
        tmp_path,
        tokenizer,
        "agree",
        kl__estimator="exact",
        rollout__temperature=0.7,
        rollout__batch_size=256,
        ppo__micro_batch_size=64,
        total_episodes=512,
    )
    trainer.train()  # two iterations: the policy has moved away from the reference
    rollout = trainer.collect_rollout()
    mask = rollout.response_mask
    k1 = masked_sum(kl_k1(rollout.logprobs, rollout.ref_logprobs), mask, dim=1)
    exact = masked_sum(rollout.full_logits_kl, mask, dim=1)
    diff = k1 - exact
    assert exact.mean() > 0.05  # a KL worth comparing
    assert abs(diff.mean()) < 4 * diff.std() / len(diff) ** 0.5, (k1.mean(), exact.mean())
    assert exact.std() < k1.std()  # the per-response reading varies less than k1's (the tokens' own noise is gone)


def _double_exact(logits, ref_logits):
    return 2.0 * exact_kl(logits, ref_logits)


def test_a_plugin_full_logits_estimator_is_used_where_exact_is(tmp_path, tokenizer):
    """An estimator registered with the trait `full_logits` gets both models' logits in the rollout, the rewards and
    the loss term, and the placement check, as `exact` does (a per-token call would get (B, T) logprobs instead)."""
    KL_ESTIMATORS.register("double_exact", full_logits=True)(_double_exact)
    try:
        cfg = Config()
        cfg.kl.estimator, cfg.kl.placement = "double_exact", "both"
        with pytest.raises(ConfigError, match="with kl.estimator `double_exact`"):
            cfg.validate()
        # beta 0: the KL acts nowhere, so both runs train alike and every KL reading is exactly doubled
        exact = _trainer(tmp_path, tokenizer, "exact", kl__estimator="exact", kl__coef=0.0).train()
        trainer = _trainer(tmp_path, tokenizer, "double", kl__estimator="double_exact", kl__coef=0.0)
        double = trainer.train()
        rollout = trainer.collect_rollout()
        rewards = trainer.token_rewards(rollout, trainer.score(rollout))
    finally:
        del KL_ESTIMATORS["double_exact"]
    assert exact[-1]["objective/kl"] > 0.0 and exact[-1]["loss/kl_avg"] > 0.0
    for e, d in zip(exact, double):
        assert d["objective/kl"] == pytest.approx(2 * e["objective/kl"], rel=1e-5, abs=1e-12)  # rollout -> rewards
        assert d["loss/kl_avg"] == pytest.approx(2 * e["loss/kl_avg"], rel=1e-5, abs=1e-12)  # the loss term
    assert rollout.ref_logits is not None and torch.equal(rewards.kl, rollout.full_logits_kl)
