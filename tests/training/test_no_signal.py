"""No update from noise, end to end on tiny in-process models: a batch whose scores carry no signal moves no policy
weight (`ppo.signal_tolerance`), in every advantage mode, and beta holds while it does not move."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import PROMPTS, small_config, tiny_llama
from lmppo.core.kl import exact_kl
from lmppo.training.trainer import PPOTrainer

HELDOUT = ["a quiet evening", "the old house", "she asked why"]  # prompts the runs never train on
MODES = {
    "critic": {"value__mode": "critic"},
    "shared": {"value__mode": "shared"},
    "grpo": {"ppo__advantage_estimator": "grpo", "rollout__num_samples_per_prompt": 4},
    "rloo": {"ppo__advantage_estimator": "rloo", "rollout__num_samples_per_prompt": 4},
}
PULL = {"kl__estimator": "exact", "kl__placement": "loss", "kl__pull_without_signal": True}  # KL steps alone


class SignalThenZero:
    """A reward with a signal (response length) for the first `signal_episodes` episodes, 0 after."""

    def __init__(self, signal_episodes: int):
        self.left = signal_episodes

    def __call__(self, prompts, completions):
        out = [len(c) / 20.0 if self.left > 0 else 0.0 for c in completions]
        self.left -= len(completions)
        return out


def policy_weights(trainer: PPOTrainer) -> list[torch.Tensor]:
    """Every parameter of the policy model and, with a shared head, of the value head (copies)."""
    actor = trainer.accelerator.unwrap_model(trainer.actor)
    params = list(trainer.policy.parameters())
    if actor.value_head is not None:
        params += list(actor.value_head.parameters())
    return [p.detach().clone() for p in params]


class WeightLog:
    def __init__(self):
        self.after: list[list[torch.Tensor]] = []

    def on_iteration_end(self, trainer, metrics):
        self.after.append(policy_weights(trainer))


def make(tmp_path, tokenizer, reward, iterations, **fields) -> PPOTrainer:
    cfg = small_config(tmp_path / "run", iterations, 8, **fields)
    return PPOTrainer(
        cfg, policy=tiny_llama(tokenizer, seed=1), tokenizer=tokenizer, prompts=PROMPTS, reward_functions=[reward]
    )


@pytest.mark.parametrize("mode", list(MODES))
def test_no_policy_step_after_the_reward_goes_silent(tmp_path, tokenizer, mode):
    """Signal for the first 16 episodes (2 iterations of 8), 0 after, no KL term: every later iteration takes no
    policy step (`policy/approxkl_avg` 0, the policy's weights bit-identical), with a critic, a shared head, grpo
    and rloo; the first two do learn (the skip is not firing everywhere)."""
    log = WeightLog()
    trainer = make(tmp_path, tokenizer, SignalThenZero(16), 5, kl__controller="fixed", kl__coef=0.0, **MODES[mode])
    trainer.callbacks.callbacks.append(log)
    critic_before = None if trainer.critic is None else [p.detach().clone() for p in trainer.critic.parameters()]
    history = trainer.train()
    assert [m["update/skipped_no_signal"] for m in history] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert all(m["policy/approxkl_avg"] > 0 for m in history[:2])
    assert not torch.equal(log.after[0][0], log.after[1][0]) or any(
        not torch.equal(a, b) for a, b in zip(log.after[0], log.after[1])
    )
    for m in history[2:]:
        assert m["policy/approxkl_avg"] == 0.0
        assert m["update/no_signal_frac"] == 1.0
    for later in log.after[2:]:
        assert all(torch.equal(a, b) for a, b in zip(log.after[1], later))
    if trainer.critic is not None:  # a separate critic keeps learning its values on the silent batches
        assert any(not torch.equal(a, b.detach()) for a, b in zip(critic_before, trainer.critic.parameters()))
        assert all(m["loss/value_avg"] > 0 for m in history[2:])


def test_zero_variance_groups_get_no_advantage(tmp_path, tokenizer):
    """With groups, a prompt whose responses all scored alike contributes nothing; the others still learn."""
    first_prompt_only = {}

    def reward(prompts, completions):
        # the first prompt's group gets a signal (lengths), every other group a constant
        first = prompts[0]
        first_prompt_only["first"] = first
        return [len(c) / 20.0 if p == first else 1.0 for p, c in zip(prompts, completions)]

    trainer = make(tmp_path, tokenizer, reward, 1, **MODES["rloo"], ppo__whiten_advantages=True)
    rollout = trainer.collect_rollout()
    scored = trainer.score(rollout)
    rewards = trainer.token_rewards(rollout, scored)
    adv, _ = trainer.advantages(rollout, rewards)
    first_group = torch.tensor([p == first_prompt_only["first"] for p in rollout.episodes.prompts.texts])
    assert rewards.signal.rows.tolist() == first_group.tolist()
    assert (adv[~first_group] == 0).all()
    assert (adv[first_group][rollout.response_mask[first_group]] != 0).any()


def test_whitening_floor_is_applied_with_a_critic(tmp_path, tokenizer):
    """`ppo.whiten_floor`: advantages divided by max(their std, floor x the critic-free advantages' std); 0 is
    plain whitening."""
    scales = {}
    for floor in (0.0, 50.0):
        trainer = make(
            tmp_path / str(floor),
            tokenizer,
            lambda p, c: [len(x) / 20.0 for x in c],
            1,
            value__mode="critic",
            ppo__whiten_floor=floor,
        )
        torch.manual_seed(0)
        rollout = trainer.collect_rollout()
        rewards = trainer.token_rewards(rollout, trainer.score(rollout))
        adv, _ = trainer.advantages(rollout, rewards)
        scales[floor] = adv[rewards.train_mask].std().item()
    assert scales[0.0] == pytest.approx(1.0, abs=1e-3)  # plain whitening: unit std
    assert scales[50.0] < 0.1  # divided by 50 x the critic-free advantages' spread, not by the critic's


def test_beta_holds_while_there_is_no_signal(tmp_path, tokenizer):
    """The issue's sequence: KL 0 on target 5 with the PI controller used to cut beta 0.05 -> 0.0025 by iteration
    5 (tests/core/test_reward_signal.py pins that arithmetic); with a silent reward it now stays 0.05."""
    trainer = make(
        tmp_path, tokenizer, lambda p, c: [0.0] * len(c), 5, kl__controller="pi", kl__coef=0.05, kl__target=5.0
    )
    history = trainer.train()
    assert [m["objective/kl_coef"] for m in history] == [0.05] * 5
    assert trainer.kl_controller.coef == 0.05 and trainer.kl_controller.integral == 0.0


def test_adaptive_controller_also_holds(tmp_path, tokenizer):
    trainer = make(tmp_path, tokenizer, lambda p, c: [0.0] * len(c), 3, kl__controller="adaptive", kl__coef=0.05)
    history = trainer.train()
    assert [m["objective/kl_coef"] for m in history] == [0.05] * 3


def heldout_kl(policy, start, tokenizer, prompts, new_tokens=6) -> float:
    """Mean over held-out prompts of the exact KL(policy || start) summed over a sampled response's tokens."""
    torch.manual_seed(0)
    total = 0.0
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = policy.generate(ids, max_new_tokens=new_tokens, do_sample=True, pad_token_id=tokenizer.pad_token_id)
        with torch.no_grad():
            logits = policy(out).logits[:, ids.shape[1] - 1 : -1]
            ref = start(out).logits[:, ids.shape[1] - 1 : -1]
        total += exact_kl(logits, ref).sum().item()
    return total / len(prompts)


@pytest.mark.parametrize("mode", ["critic", "shared", "grpo_pull"])
def test_always_zero_reward_keeps_the_policy_at_its_start(tmp_path, tokenizer, mode):
    """A reward that is always 0 for 8 iterations: the held-out KL to the start stays below 0.05 nats (it is 0:
    no step was taken). Before the skip, whitening scaled the critic's noise up to unit advantages. With
    `kl.pull_without_signal` (`grpo_pull`) the steps are taken, on a KL term whose gradient is 0 at the reference."""
    policy = tiny_llama(tokenizer, seed=2)
    start = copy.deepcopy(policy).eval()
    fields = {**MODES["grpo"], **PULL} if mode == "grpo_pull" else MODES[mode]
    cfg = small_config(tmp_path / "run", 8, 8, **fields)
    trainer = PPOTrainer(
        cfg, policy=policy, tokenizer=tokenizer, prompts=PROMPTS, reward_functions=[lambda p, c: [0.0] * len(c)]
    )
    history = trainer.train()
    assert all(m["update/skipped_no_signal"] == 1.0 for m in history)
    assert all(m["update/kl_pull"] == float(mode == "grpo_pull") for m in history)
    kl = heldout_kl(trainer.policy.eval(), start, tokenizer, HELDOUT)
    assert kl < 0.05
    if mode != "grpo_pull":
        assert kl == pytest.approx(0.0, abs=1e-6)


def test_signal_tolerance_is_applied(tmp_path, tokenizer):
    """Scores 0.001 apart: a signal at the default tolerance (1e-6), none at `ppo.signal_tolerance` 0.01."""

    def nearly_equal(prompts, completions):
        return [0.5 + 0.001 * (i % 2) for i in range(len(completions))]

    skipped = {}
    for tolerance in (1e-6, 0.01):
        trainer = make(tmp_path / str(tolerance), tokenizer, nearly_equal, 1, ppo__signal_tolerance=tolerance)
        skipped[tolerance] = trainer.train()[0]["update/skipped_no_signal"]
    assert skipped == {1e-6: 0.0, 0.01: 1.0}


@pytest.mark.parametrize("field", ["ppo.signal_tolerance", "ppo.whiten_floor"])
def test_negative_knobs_are_refused(field):
    from lmppo.config import load_config
    from lmppo.errors import ConfigError

    with pytest.raises(ConfigError, match=field.split(".")[1]):
        load_config(None, {field: "-1"})


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "gae"])
def test_critic_free_estimators_train_no_value_head(tmp_path, tokenizer, estimator):
    """Trait `uses_values`: with `grpo` / `rloo` the shared value head (and so the trunk, through it) gets no value
    gradient (`ppo.vf_coef` counts as 0); with `gae` it learns."""
    groups = {} if estimator == "gae" else {"rollout__num_samples_per_prompt": 4}
    trainer = make(
        tmp_path,
        tokenizer,
        lambda p, c: [len(x) / 20.0 for x in c],
        1,
        ppo__advantage_estimator=estimator,
        ppo__vf_coef=0.5,
        **groups,
    )
    head = trainer.accelerator.unwrap_model(trainer.actor).value_head
    before = [p.detach().clone() for p in head.parameters()]
    trainer.train()
    moved = any(not torch.equal(a, b) for a, b in zip(before, head.parameters()))
    assert moved == (estimator == "gae")


class Snapshot:
    """A copy of the policy after iteration `at` (1-based)."""

    def __init__(self, at: int):
        self.at, self.policy = at, None

    def on_iteration_end(self, trainer, metrics):
        if trainer.iteration == self.at:
            self.policy = copy.deepcopy(trainer.policy).eval()


@pytest.mark.parametrize("mode", ["critic", "shared", "grpo"])
def test_kl_pull_brings_a_silent_run_back_toward_the_reference(tmp_path, tokenizer, mode):
    """`kl.pull_without_signal` with the KL in the loss (`exact`, beta 5): signal for 2 iterations, then 4 silent
    ones. Off, the silent iterations leave the policy where the signal left it (the held-out KL to the start, which
    is the reference, stays what it was); on, they step on the KL term alone (`update/kl_pull` 1,
    `policy/approxkl_avg` above 0) and the held-out KL to the start falls."""
    start = tiny_llama(tokenizer, seed=1).eval()
    kl_at_2, kl_end, history = {}, {}, {}
    for pull in (False, True):
        snap = Snapshot(2)
        trainer = make(
            tmp_path / str(pull),
            tokenizer,
            SignalThenZero(16),
            6,
            kl__controller="fixed",
            kl__coef=5.0,
            **{**PULL, "kl__pull_without_signal": pull},
            ppo__learning_rate=1e-2,
            **MODES[mode],
        )
        trainer.callbacks.callbacks.append(snap)
        history[pull] = trainer.train()
        kl_at_2[pull] = heldout_kl(snap.policy, start, tokenizer, HELDOUT)
        kl_end[pull] = heldout_kl(trainer.policy.eval(), start, tokenizer, HELDOUT)
    assert kl_at_2[True] == pytest.approx(kl_at_2[False], rel=1e-4)  # the same run until the reward goes silent
    assert kl_at_2[False] > 0.05  # the signal moved the policy away from the start
    assert kl_end[False] == pytest.approx(kl_at_2[False], rel=1e-4)  # held
    assert kl_end[True] < 0.75 * kl_at_2[True]  # pulled back (to 0.48-0.62 of it here)
    for pull, expected in ((False, 0.0), (True, 1.0)):
        silent = history[pull][2:]
        assert [m["update/skipped_no_signal"] for m in silent] == [1.0] * 4
        assert [m["update/kl_pull"] for m in silent] == [expected] * 4
        assert all((m["policy/approxkl_avg"] > 0) == bool(expected) for m in silent)
    assert [m["update/kl_pull"] for m in history[True][:2]] == [0.0, 0.0]


def test_kl_pull_takes_no_step_without_a_kl_term(tmp_path, tokenizer):
    """With beta 0 there is nothing to pull with: a silent batch holds the policy, the option on or off."""
    trainer = make(
        tmp_path,
        tokenizer,
        lambda p, c: [0.0] * len(c),
        2,
        kl__controller="fixed",
        kl__coef=0.0,
        kl__placement="loss",
        kl__pull_without_signal=True,
    )
    before = policy_weights(trainer)
    history = trainer.train()
    assert [m["update/kl_pull"] for m in history] == [0.0, 0.0]
    assert all(torch.equal(a, b) for a, b in zip(before, policy_weights(trainer)))


def test_kl_pull_needs_a_kl_term_in_the_loss():
    """Refused, naming the field and what it needs, where there is no loss term to pull with."""
    from lmppo.config import load_config
    from lmppo.errors import ConfigError

    with pytest.raises(ConfigError, match=r"kl.pull_without_signal.*kl.placement `loss` or `both` \(it is `reward`\)"):
        load_config(None, {"kl.pull_without_signal": "true"}).validate()
    for other in ({"kl.placement": "both"}, {"kl.placement": "loss"}, {"kl.estimator": "exact"}):
        assert load_config(None, {"kl.pull_without_signal": "true", **other}).validate().kl.pull_without_signal
