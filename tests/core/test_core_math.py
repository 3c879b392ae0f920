"""Core math against values worked out by hand (see shared/STYLE.md), plus invariance checks."""

import math

import pytest
import torch

from lmppo.core.advantages import ADVANTAGE_ESTIMATORS, gae, register_advantage_estimator
from lmppo.core.kl import KL_ESTIMATORS, register_kl_estimator
from lmppo.core.kl_control import AdaptiveKLController, FixedKLController
from lmppo.core.logprobs import entropy_from_logits, selective_log_softmax
from lmppo.core.losses import clipped_policy_loss, clipped_value_loss, token_mean
from lmppo.core.masking import (
    first_true_index,
    last_true_index,
    masked_mean,
    masked_var,
    masked_whiten,
    stop_token_mask,
)
from lmppo.core.rewards import bootstrap_truncated, kl_penalized_rewards, penalize_truncated


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


# ---------------------------------------------------------------- GAE
@pytest.mark.parametrize(
    "lam, adv, ret",
    [
        (1.0, [0.5, 0.5, 0.5], [1.0, 1.0, 1.0]),
        (0.5, [0.125, 0.25, 0.5], [0.625, 0.75, 1.0]),
    ],
)
def test_gae_hand_worked(lam, adv, ret):
    rewards, values = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.5, 0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    a, r = gae(rewards, values, mask, gamma=1.0, lam=lam)
    assert torch.allclose(a, t([adv])) and torch.allclose(r, t([ret]))


def test_gae_discount_hand_worked():
    # gamma=0.5, lam=1: deltas = [0 + .5*.5 - .5, 0 + .5*.5 - .5, 1 - .5] = [-.25, -.25, .5]
    # A2 = .5; A1 = -.25 + .5*.5 = 0; A0 = -.25 + .5*0 = -.25
    a, r = gae(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.5, 0.5]]), torch.ones(1, 3, dtype=torch.bool), gamma=0.5, lam=1.0)
    assert torch.allclose(a, t([[-0.25, 0.0, 0.5]]))
    assert torch.allclose(r, t([[0.25, 0.5, 1.0]]))


def naive_gae(rewards, values, lengths, gamma, lam):
    B, T = rewards.shape
    adv = torch.zeros(B, T)
    for b in range(B):
        last = 0.0
        for i in reversed(range(int(lengths[b]))):
            nv = values[b, i + 1].item() if i + 1 < lengths[b] else 0.0
            delta = rewards[b, i].item() + gamma * nv - values[b, i].item()
            last = delta + gamma * lam * last
            adv[b, i] = last
    ret = adv + values * (torch.arange(T)[None] < lengths[:, None])
    return adv, ret


def test_gae_matches_naive_loop_and_ignores_masked_positions():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 11
    rewards, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    lengths = torch.tensor([11, 1, 5, 7, 3, 10])
    mask = torch.arange(T)[None] < lengths[:, None]
    a, r = gae(rewards, values, mask, gamma=0.97, lam=0.9)
    na, nr = naive_gae(rewards, values, lengths, 0.97, 0.9)
    assert torch.allclose(a, na, atol=1e-5) and torch.allclose(r, nr * mask, atol=1e-5)
    # garbage (even inf) at masked positions changes nothing
    junk_r = torch.where(mask, rewards, torch.full_like(rewards, 1e6))
    junk_v = torch.where(mask, values, torch.full_like(values, float("inf")))
    a2, r2 = gae(junk_r, junk_v, mask, gamma=0.97, lam=0.9)
    assert torch.equal(a, a2) and torch.equal(r, r2)
    assert (a[~mask] == 0).all()


def test_advantage_registry_rejects_duplicates():
    assert ADVANTAGE_ESTIMATORS["gae"] is gae
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("gae")(gae)


# ---------------------------------------------------------------- KL
def test_kl_estimators_hand_worked():
    lp, ref = t([math.log(0.5)]), t([math.log(0.25)])
    assert KL_ESTIMATORS["k1"](lp, ref).item() == pytest.approx(0.6931, abs=1e-4)
    assert KL_ESTIMATORS["k2"](lp, ref).item() == pytest.approx(0.2402, abs=1e-4)
    assert KL_ESTIMATORS["k3"](lp, ref).item() == pytest.approx(0.1931, abs=1e-4)
    with pytest.raises(ValueError):
        register_kl_estimator("k1")(KL_ESTIMATORS["k1"])


def test_k1_and_k3_unbiased_on_exact_distribution():
    # E_{x~p}[k1] = E_{x~p}[k3] = KL(p||q) exactly when weighting each outcome by p(x)
    p, q = t([0.5, 0.3, 0.2]), t([0.2, 0.5, 0.3])
    kl = (p * (p / q).log()).sum()
    for name in ("k1", "k3"):
        est = (p * KL_ESTIMATORS[name](p.log(), q.log())).sum()
        assert est.item() == pytest.approx(kl.item(), abs=1e-6)
    assert (KL_ESTIMATORS["k3"](p.log(), q.log()) >= 0).all()


def test_adaptive_kl_controller_sequence():
    # target 6, horizon 10000, 8 episodes a step:
    # kl 12 -> error clipped to +0.2 -> beta *= 1 + 0.2*8/10000 = 1.00016
    # kl 3  -> error -0.5 clipped to -0.2 -> beta *= 0.99984
    # kl 7.5 -> error 0.25 clipped 0.2;  kl 6.6 -> error 0.1 -> *1.00008
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000, batch_size=8)
    expected = 0.1
    for kl, mult in [(12, 1.00016), (3, 0.99984), (7.5, 1.00016), (6.6, 1.00008)]:
        c.update(kl)
        expected *= mult
        assert c.coef == pytest.approx(expected, rel=1e-12)
    f = FixedKLController(0.05)
    f.update(100.0)
    assert f.coef == 0.05
    c2 = AdaptiveKLController(1.0, 6.0, 10000, 8)
    c2.load_state_dict(c.state_dict())
    assert c2.coef == c.coef


# ---------------------------------------------------------------- losses
def test_clipped_policy_loss_hand_worked():
    old = torch.zeros(1, 2)
    new = t([[math.log(1.5), math.log(0.5)]])
    adv = t([[1.0, -1.0]])
    loss, stats = clipped_policy_loss(new, old, adv, clip_range=0.2)
    assert torch.allclose(loss, t([[-1.2, 0.8]]))
    assert torch.equal(stats["clipped"], t([[1.0, 1.0]]))
    assert torch.allclose(stats["ratio"], t([[1.5, 0.5]]))
    # inside the clip range nothing is clipped: ratio 1.1, A = 2 -> -2.2
    loss, stats = clipped_policy_loss(t([[math.log(1.1)]]), torch.zeros(1, 1), t([[2.0]]), 0.2)
    assert loss.item() == pytest.approx(-2.2) and stats["clipped"].item() == 0.0
    assert stats["approx_kl"].item() == pytest.approx(0.5 * math.log(1.1) ** 2)


def test_clipped_value_loss_hand_worked():
    # old .0, new 1.0, return 2.0, clip .2: unclipped (1-2)^2 = 1; clipped (0.2-2)^2 = 3.24 -> 0.5*3.24
    loss, stats = clipped_value_loss(t([[1.0]]), t([[0.0]]), t([[2.0]]), clip_range=0.2)
    assert loss.item() == pytest.approx(1.62) and stats["clipped"].item() == 1.0
    # new value moving towards the return within clip: 0.5 * (0.1 - 0)^2
    loss, stats = clipped_value_loss(t([[0.1]]), t([[0.0]]), t([[0.0]]), 0.2)
    assert loss.item() == pytest.approx(0.005) and stats["clipped"].item() == 0.0


def test_token_mean_is_invariant_to_micro_batch_split():
    g = torch.Generator().manual_seed(1)
    B, T = 8, 9
    per_token = torch.randn(B, T, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    full = masked_mean(per_token, mask)
    n = mask.sum()
    for split in (1, 2, 4, 8):
        total = sum(token_mean(per_token[i : i + split], mask[i : i + split], n) for i in range(0, B, split))
        assert torch.allclose(total, full, atol=1e-6)


# ---------------------------------------------------------------- logprobs
def test_selective_log_softmax_matches_naive():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 17, generator=g)
    idx = torch.randint(0, 17, (3, 5), generator=g)
    naive = torch.log_softmax(logits, -1).gather(-1, idx[..., None]).squeeze(-1)
    assert torch.allclose(selective_log_softmax(logits, idx), naive, atol=1e-6)
    # hand-worked: logits [0, log 3] -> p = [.25, .75]
    assert selective_log_softmax(t([[0.0, math.log(3)]]), torch.tensor([1])).item() == pytest.approx(math.log(0.75))


def test_entropy_from_logits():
    # uniform over 4 -> log 4; [.25,.75] -> -(.25 ln .25 + .75 ln .75) = 0.5623
    assert entropy_from_logits(torch.zeros(1, 1, 4)).item() == pytest.approx(math.log(4), abs=1e-6)
    assert entropy_from_logits(t([[[0.0, math.log(3)]]])).item() == pytest.approx(0.5623, abs=1e-4)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 70, 11, generator=g)
    p = torch.softmax(logits, -1)
    assert torch.allclose(entropy_from_logits(logits, chunk_size=16), -(p * p.log()).sum(-1), atol=1e-5)


# ---------------------------------------------------------------- masking
def test_masked_stats_hand_worked():
    x = t([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[True, True, True, False]])
    assert masked_mean(x, m).item() == pytest.approx(2.0)
    assert masked_var(x, m).item() == pytest.approx(1.0)  # ((1)+(0)+(1))/2
    w = masked_whiten(x, m)
    assert torch.allclose(w, t([[-1.0, 0.0, 1.0, 0.0]]), atol=1e-4)
    w2 = masked_whiten(x, m, shift_mean=False)
    assert torch.allclose(w2[:, :3], t([[1.0, 2.0, 3.0]]), atol=1e-4)


def test_stop_token_mask_and_indices():
    ids = torch.tensor([[5, 9, 2, 2], [5, 6, 7, 8], [2, 3, 3, 3]])
    mask, terminated = stop_token_mask(ids, torch.tensor([2]))
    assert mask.tolist() == [[True, True, True, False], [True] * 4, [True, False, False, False]]
    assert terminated.tolist() == [True, False, True]
    assert last_true_index(mask).tolist() == [2, 3, 0]
    assert first_true_index(ids == 7).tolist() == [4, 2, 4]
    mask, terminated = stop_token_mask(ids, torch.tensor([], dtype=torch.long))
    assert mask.all() and not terminated.any()


# ---------------------------------------------------------------- per-token rewards
def test_kl_penalized_rewards_and_score_placement():
    scores = t([[0.0, 0.0, 2.0, 0.0]])  # score placed on last real token (index 2)
    kl = t([[0.1, 0.2, 0.3, 9.0]])
    mask = torch.tensor([[True, True, True, False]])
    r = kl_penalized_rewards(scores, kl, 0.5, mask)
    assert torch.allclose(r, t([[-0.05, -0.1, 1.85, 0.0]]))


def test_truncation_penalty_and_bootstrap():
    scores = t([[0.0, 0.3, 0.7], [0.0, 1.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    truncated = torch.tensor([True, False])
    replaced = penalize_truncated(scores, mask, truncated, -1.0, "replace")
    assert torch.allclose(replaced, t([[0.0, 0.0, -1.0], [0.0, 1.0, 0.0]]))
    added = penalize_truncated(scores, mask, truncated, -1.0, "add")
    assert torch.allclose(added, t([[0.0, 0.3, -0.3], [0.0, 1.0, 0.0]]))
    boot = bootstrap_truncated(scores, mask, truncated, t([2.0, 5.0]), gamma=0.9)
    assert torch.allclose(boot, t([[0.0, 0.3, 2.5], [0.0, 1.0, 0.0]]))


def test_bootstrap_gae_with_known_final_value():
    # one truncated response of 2 tokens, rewards [0, 1], values [.5, .5], V(s_T) = 2, gamma = 1, lam = 1
    # bootstrapped rewards [0, 3] -> deltas [0 + .5 - .5, 3 - .5] = [0, 2.5] -> A = [2.5, 2.5], R = [3, 3]
    mask = torch.ones(1, 2, dtype=torch.bool)
    r = bootstrap_truncated(t([[0.0, 1.0]]), mask, torch.tensor([True]), t([2.0]), gamma=1.0)
    a, ret = gae(r, t([[0.5, 0.5]]), mask, gamma=1.0, lam=1.0)
    assert torch.allclose(a, t([[2.5, 2.5]])) and torch.allclose(ret, t([[3.0, 3.0]]))


# ---------------------------------------------------------------- group estimators
def test_rloo_hand_worked():
    # two prompts, 3 samples each; per-response totals: group a: 1, 2, 6 ; group b: 0, 0, 3
    # rloo: a -> 1-(2+6)/2=-3, 2-(1+6)/2=-1.5, 6-(1+2)/2=4.5 ; b -> 0-1.5=-1.5, -1.5, 3-0=3
    rewards = t([[0.0, 1.0], [2.0, 0.0], [5.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 2.0]])
    mask = torch.ones(6, 2, dtype=torch.bool)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv, ret = ADVANTAGE_ESTIMATORS["rloo"](rewards, torch.zeros(6, 2), mask, gamma=1.0, lam=1.0, group_ids=groups)
    assert torch.allclose(adv[:, 0], t([-3.0, -1.5, 4.5, -1.5, -1.5, 3.0]))
    assert torch.equal(adv[:, 0], adv[:, 1])
    assert torch.allclose(ret, t([[1.0, 1.0], [2.0, 0.0], [6.0, 1.0], [0.0, 0.0], [0.0, 0.0], [3.0, 2.0]]))


def test_grpo_hand_worked_and_masking():
    # group totals 1, 3 -> mean 2, population std 1 -> advantages -1, +1 (up to the 1e-6)
    rewards = t([[0.0, 1.0, 50.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    adv, _ = ADVANTAGE_ESTIMATORS["grpo"](
        rewards, torch.zeros(2, 3), mask, gamma=1.0, lam=1.0, group_ids=torch.tensor([7, 7])
    )
    assert torch.allclose(adv, t([[-1.0, -1.0, 0.0], [1.0, 1.0, 1.0]]), atol=1e-5)
    with pytest.raises(ValueError, match="group_ids"):
        ADVANTAGE_ESTIMATORS["grpo"](rewards, torch.zeros(2, 3), mask, gamma=1.0, lam=1.0)


def test_reinforce_pp_returns_to_go_hand_worked():
    # rewards [1, 0, 2], gamma 0.5 -> G = [1 + 0 + 0.25*2, 0 + 0.5*2, 2] = [1.5, 1, 2]
    adv, ret = ADVANTAGE_ESTIMATORS["reinforce_pp"](
        t([[1.0, 0.0, 2.0]]), t([[9.0, 9.0, 9.0]]), torch.ones(1, 3, dtype=torch.bool), gamma=0.5, lam=0.3
    )
    assert torch.allclose(adv, t([[1.5, 1.0, 2.0]])) and torch.equal(adv, ret)
