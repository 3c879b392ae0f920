"""The PPO objective (`lmppo.core.objective.ppo_objective`) against a 2 x 3 example worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from lmppo.core.objective import STAT_NAMES, ppo_objective

LN2 = math.log(2)

# Two responses of 3 tokens, the last token of the second is padding. Vocabulary of 2 with logits [0, 0]
# everywhere: pi(a|s) = 0.5 for every token, log pi = -ln 2, entropy H = ln 2 at every position.
# ratios r = pi / pi_old are set through old log pi = -ln 2 - ln r.
#                 tok 0   tok 1   tok 2 (row 1: padding)
RATIO = [[1.5, 0.5, 1.0], [1.1, 0.7, 2.0]]
ADV = [[1.0, -1.0, 1.0], [-1.0, 1.0, 5.0]]
# policy loss max(-A r, -A clip(r, 0.8, 1.2)):
#   row 0:  max(-1.5, -1.2) = -1.2 (clipped) | max(0.5, 0.8) = 0.8 (clipped) | max(-1, -1) = -1
#   row 1:  max(1.1, 1.1) = 1.1             | max(-0.7, -0.8) = -0.7
#   sum -1.0 over 5 real tokens: mean -0.2; clip fraction 2/5
# approx KL 0.5 (ln r)^2: 0.0822013, 0.2402265, 0, 0.0045415, 0.0636086: mean 0.0781156
VALUES = [[0.5, -0.1, 0.0], [0.3, 0.2, 9.0]]
OLD_VALUES = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
RETURNS = [[1.0, 0.0, 0.5], [0.0, 0.2, -9.0]]
# value loss 0.5 max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, -0.2, 0.2):
#   row 0:  V 0.5 -> V_clip 0.2: 0.5 max(0.25, 0.64) = 0.32 (clipped) | 0.5 * 0.01 = 0.005 | 0.5 * 0.25 = 0.125
#   row 1:  V 0.3 -> V_clip 0.2: 0.5 max(0.09, 0.04) = 0.045           | 0
#   sum 0.495: mean 0.099; clip fraction 1/5
# KL term, r_ref = pi_ref / pi set through log pi_ref = -ln 2 + ln r_ref:
R_REF = [[0.5, 1.0, 1.0], [2.0, 1.0, 1.0]]
#   k3 = (r_ref - 1) - ln r_ref: 0.5 - 1 + ln 2 = 0.1931472 and 2 - 1 - ln 2 = 0.3068528, 0 elsewhere: sum 0.5
#   k1 = ln pi - ln pi_ref = -ln r_ref: ln 2 and -ln 2: sum 0
#   k2 = 0.5 (ln r_ref)^2: 0.2402265 twice: sum 0.480453
MASK = [[True, True, True], [True, True, False]]
# total, vf_coef 0.5, entropy_coef 0.01, kl_coef 0.1, k3: sum over the real tokens of
#   pg + 0.5 vf - 0.01 H + 0.1 k3 = -1.0 + 0.2475 - 0.05 ln 2 + 0.05 = -0.7371574, / 5 tokens = -0.1474315


def inputs(**changes):
    logits = torch.zeros(2, 3, 2, requires_grad=True)
    ids = torch.zeros(2, 3, dtype=torch.long)
    args = dict(
        logits=logits,
        values=torch.tensor(VALUES, requires_grad=True),
        response_ids=ids,
        old_logprobs=-LN2 - torch.tensor(RATIO).log(),
        old_values=torch.tensor(OLD_VALUES),
        advantages=torch.tensor(ADV),
        returns=torch.tensor(RETURNS),
        mask=torch.tensor(MASK),
        denominator=5.0,
        clip_range=0.2,
        value_clip_range=0.2,
        vf_coef=0.5,
        entropy_coef=0.01,
        kl_coef=0.1,
        kl_estimator="k3",
        ref_logprobs=-LN2 + torch.tensor(R_REF).log(),
    )
    args.update(changes)
    return args


def test_hand_worked_loss_and_stats():
    loss, stats = ppo_objective(**inputs())
    assert loss.item() == pytest.approx((-1.0 + 0.2475 - 0.05 * LN2 + 0.05) / 5, abs=1e-6)
    assert loss.item() == pytest.approx(-0.1474315, abs=1e-6)
    expected = {
        "loss/policy_avg": -0.2,
        "loss/value_avg": 0.099,
        "policy/clipfrac_avg": 0.4,
        "val/clipfrac_avg": 0.2,
        "policy/approxkl_avg": 0.0781156,
        "policy/entropy_avg": LN2,
        "val/ratio": (1.5 + 0.5 + 1.0 + 1.1 + 0.7) / 5,
        "loss/kl_avg": 0.1,
    }
    assert set(stats) == set(expected) == set(STAT_NAMES.values())
    for name, value in expected.items():
        assert stats[name].item() == pytest.approx(value, abs=1e-6), name
        assert not stats[name].requires_grad


def test_the_configured_estimator_sets_the_kl_term():
    base = ppo_objective(**inputs(kl_estimator=None))[0].item()
    assert base == pytest.approx((-1.0 + 0.2475 - 0.05 * LN2) / 5, abs=1e-6)
    for name, kl_sum in (("k1", 0.0), ("k2", LN2**2), ("k3", 0.5)):
        loss, stats = ppo_objective(**inputs(kl_estimator=name))
        assert loss.item() == pytest.approx(base + 0.1 * kl_sum / 5, abs=1e-6), name
        assert stats["loss/kl_avg"].item() == pytest.approx(kl_sum / 5, abs=1e-6), name
    assert "loss/kl_avg" not in ppo_objective(**inputs(kl_estimator=None))[1]


def test_exact_kl_term_reads_the_reference_logits():
    # pi = (0.5, 0.5), pi_ref = (0.75, 0.25): KL = 0.5 ln(0.5 / 0.75) + 0.5 ln(0.5 / 0.25) = 0.1438410 per token
    ref_logits = torch.tensor([math.log(3.0), 0.0]).expand(2, 3, 2)
    loss, stats = ppo_objective(**inputs(kl_estimator="exact", ref_logits=ref_logits, ref_logprobs=None))
    base = ppo_objective(**inputs(kl_estimator=None))[0].item()
    assert stats["loss/kl_avg"].item() == pytest.approx(0.1438410, abs=1e-6)
    assert loss.item() == pytest.approx(base + 0.1 * 5 * 0.1438410 / 5, abs=1e-6)


def test_coefficients_and_token_count_scale_their_terms():
    a = ppo_objective(**inputs(kl_estimator=None, entropy_coef=0.0))[0].item()
    assert a == pytest.approx((-1.0 + 0.2475) / 5, abs=1e-6)
    assert ppo_objective(**inputs(kl_estimator=None, entropy_coef=0.0, vf_coef=0.0))[0].item() == pytest.approx(
        -0.2, abs=1e-6
    )
    # a micro-batch of a minibatch of 10 real tokens: half the share
    assert ppo_objective(**inputs(denominator=10.0))[0].item() == pytest.approx(-0.7371574 / 10, abs=1e-6)
    # clip ranges: eps 0.6 clips nothing in the policy loss: -1.5 + 0.5 - 1 + 1.1 - 0.7 = -1.6
    wide, stats = ppo_objective(**inputs(clip_range=0.6, value_clip_range=10.0, kl_estimator=None, entropy_coef=0.0))
    assert stats["loss/policy_avg"].item() == pytest.approx(-1.6 / 5, abs=1e-6)
    # value clip 10: unclipped 0.5 (0.25 + 0.01 + 0.25 + 0.09 + 0) = 0.3
    assert stats["loss/value_avg"].item() == pytest.approx(0.3 / 5, abs=1e-6)


def test_entropy_gets_a_gradient_only_with_a_coefficient():
    args = inputs(kl_estimator=None, vf_coef=0.0, entropy_coef=0.0)
    ppo_objective(**args)[0].backward()
    without = args["logits"].grad.clone()
    args = inputs(kl_estimator=None, vf_coef=0.0, entropy_coef=0.5)
    ppo_objective(**args)[0].backward()
    # uniform logits sit at the entropy's maximum: its gradient there is 0, so the policy gradient is unchanged
    assert torch.allclose(args["logits"].grad, without, atol=1e-7)
    skewed = torch.tensor([[1.0, 0.0]]).expand(2, 3, 2).clone().requires_grad_(True)
    (g0,) = torch.autograd.grad(ppo_objective(**inputs(logits=skewed, kl_estimator=None, entropy_coef=0.0))[0], skewed)
    (g1,) = torch.autograd.grad(ppo_objective(**inputs(logits=skewed, kl_estimator=None, entropy_coef=0.5))[0], skewed)
    assert not torch.allclose(g0, g1)


def test_padding_never_changes_a_result():
    loss, stats = ppo_objective(**inputs())
    noisy = inputs()
    for name in ("old_logprobs", "advantages", "returns", "old_values"):
        noisy[name] = noisy[name].clone()
        noisy[name][1, 2] = float("nan") if name != "advantages" else 1e9
    other, other_stats = ppo_objective(**noisy)
    assert other.item() == pytest.approx(loss.item(), abs=1e-7)
    assert {k: round(v.item(), 7) for k, v in other_stats.items()} == {k: round(v.item(), 7) for k, v in stats.items()}


def test_the_aggregation_weighs_the_tokens():
    """`ppo.loss_aggregation` on the policy loss alone: row 0's tokens -1.2, 0.8, -1 (mean -1.4 / 3), row 1's
    1.1, -0.7 (mean 0.2); the whole per-token loss is aggregated (value, entropy and KL terms alike)."""
    policy_only = dict(kl_estimator=None, entropy_coef=0.0, vf_coef=0.0)
    sequence = ppo_objective(**inputs(**policy_only, aggregation="sequence_mean", denominator=2.0))[0].item()
    assert sequence == pytest.approx((-1.4 / 3 + 0.2) / 2, abs=1e-6)
    fixed = ppo_objective(**inputs(**policy_only, aggregation="fixed_length", denominator=2.0 * 3))[0].item()
    assert fixed == pytest.approx(-1.0 / 6, abs=1e-6)
    # all terms: row 0's sum -1.2 + 0.8 - 1 + 0.5 (0.32 + 0.005 + 0.125) - 0.03 ln 2 + 0.1 * 0.1931472, over 3 tokens
    row0 = (-1.4 + 0.225 - 0.03 * LN2 + 0.01931472) / 3
    row1 = (0.4 + 0.5 * 0.045 - 0.02 * LN2 + 0.1 * 0.3068528) / 2
    whole = ppo_objective(**inputs(aggregation="sequence_mean", denominator=2.0))[0].item()
    assert whole == pytest.approx((row0 + row1) / 2, abs=1e-6)
