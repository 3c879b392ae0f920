"""Phases 2 to 4 of an iteration: the reward sources' scores placed on response tokens, the per-token rewards
(scores minus beta * KL, the truncation policy) and the advantages."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable

import torch

from lmppo.config import Config, KLConfig, RewardConfig, RolloutConfig
from lmppo.core.advantages import ADVANTAGE_ESTIMATORS, population_std
from lmppo.core.kl import KL_ESTIMATORS, next_state_kl
from lmppo.core.kl_control import KL_CONTROLLERS
from lmppo.core.masking import masked_sum
from lmppo.core.rewards import (
    RunningMoments,
    add_on_last_token,
    bootstrap_truncated,
    kl_penalized_rewards,
    normalize_scores,
    overlong_penalty,
    penalize_truncated,
    score_range,
    signal_rows,
    unfinished_scores,
)
from lmppo.rewards import RewardResult
from lmppo.training.batch import Rollout

if TYPE_CHECKING:
    from lmppo.data.prompts import PromptStream
    from lmppo.distributed.strategy import Strategy


@dataclass
class ScoredRollout:
    """Phase 2 output: scores placed on response tokens."""

    token_scores: torch.Tensor  # (B, T) weighted sum of the sources' placed scores, normalised/clipped, then the
    #                             truncation penalty; all 0 on invalid rows
    raw_scores: torch.Tensor  # (B,) per-response total before truncation penalty / normalisation
    valid: torch.Tensor  # (B,) bool, False where a reward source gave bad output and on_bad_output = drop
    per_source: dict[str, torch.Tensor]  # name -> (B,) unweighted per-response totals
    overlong: torch.Tensor | None = None  # (B,) `reward.overlong_buffer`'s penalty in token_scores; None: off


@dataclass
class RewardSignal:
    """Which responses' scores tell better from worse (`ppo.signal_tolerance`, `lmppo.core.rewards.signal_rows`)."""

    rows: torch.Tensor  # (B,) bool: valid rows whose group (or batch) scores spread by more than the tolerance
    any: bool  # some row of some process has a signal: the policy may take a step from this batch


@dataclass
class TokenRewards:
    """Phase 3 output."""

    rewards: torch.Tensor  # (B, T) score placement minus beta * KL (+ bootstrap)
    kl_reading: KLReading  # the batch's KL to the reference (`read_kl`)
    train_mask: torch.Tensor  # (B, T) bool, tokens that get policy and value gradients
    signal: RewardSignal | None = None  # None: every row counts as carrying a signal

    @property
    def kl(self) -> torch.Tensor:
        """(B, T) per-token KL estimate (0 at padding)."""
        return self.kl_reading.per_token


def score(
    rollout: Rollout,
    result: RewardResult,
    rc: RewardConfig,
    score_moments: RunningMoments,
    device: torch.device,
    sampling: RolloutConfig,
) -> ScoredRollout:
    """The road's scores of the rollout's episodes (`result`, `lmppo.episodes.road.Road.score`: the sources on the
    last turn, the environment's on each turn), normalised (`reward.normalize`, updating `score_moments`) or
    clipped, the truncation policy's score changes, then the overlong penalty (`reward.overlong_buffer` before
    `sampling.max_new_tokens`, on every row, truncated ones included)."""
    token_scores = placed = result.token_scores.to(device, torch.float32)
    raw = token_scores.sum(1)
    mask, valid = rollout.policy_mask, result.valid.to(device)
    if rc.normalize or rc.clip > 0:
        if rc.normalize:
            score_moments.update(raw[valid])
        mean, std = (score_moments.mean, score_moments.std) if rc.normalize else (0.0, 1.0)
        token_scores = normalize_scores(token_scores, mask, mean, std, rc.clip)
    if rc.truncation == "penalty":  # after normalisation: a cut response scores exactly `reward.penalty`
        token_scores = penalize_truncated(token_scores, mask, rollout.truncated, rc.penalty, rc.penalty_mode)
    if rc.truncation == "bootstrap":  # a cut response did not finish: only its per-token/span scores stay
        token_scores = unfinished_scores(
            token_scores,
            placed,
            mask,
            rollout.truncated,
            result.final_scores.to(device),
            score_moments.std if rc.normalize else 1.0,
        )
    overlong = None
    if rc.overlong_buffer:  # after normalisation and the truncation policy: in the units the policy is trained on
        overlong = overlong_penalty(mask.sum(1), sampling.max_new_tokens, rc.overlong_buffer, rc.overlong_penalty)
        token_scores = add_on_last_token(token_scores, mask, overlong)
    token_scores = torch.where(valid[:, None], token_scores, torch.zeros_like(token_scores))
    return ScoredRollout(
        token_scores=token_scores,
        raw_scores=raw,
        valid=valid,
        per_source={k: v.to(device) for k, v in result.per_source.items()},
        overlong=overlong,
    )


def kl_reacts_now(kl: KLConfig) -> bool:
    """`kl.react` (`auto`: the controller's trait `react`): whether beta answers a batch's KL before its rewards."""
    return (KL_CONTROLLERS.trait(kl.controller, "react") if kl.react == "auto" else kl.react) == "now"


def reward_signal(
    rollout: Rollout,
    scored: ScoredRollout,
    tolerance: float,
    processes: Strategy,
) -> RewardSignal:
    """The rows of the batch whose scores carry a signal (`ppo.signal_tolerance`): per prompt group when the rollout
    has groups of several responses (a group never spans processes), else over the whole batch of every process.
    `processes`: the strategy, for its reductions of a 0-dim tensor over processes."""
    scores = scored.token_scores.sum(1)  # (B,) what the policy is trained on, before the KL penalty
    groups = rollout.group_ids  # (B,); one response per prompt (every id once) compares nothing within a group
    grouped = groups is not None and groups.unique().numel() < groups.numel()
    highest, lowest = score_range(scores, scored.valid, groups if grouped else None)
    if not grouped:  # the batch of every process is one comparison
        highest = torch.full_like(scores, processes.process_max(highest.max()))
        lowest = torch.full_like(scores, -processes.process_max(-lowest.min()))
    rows = signal_rows(highest, lowest, scored.valid, tolerance)
    return RewardSignal(rows=rows, any=processes.process_sum(rows.sum()) > 0)


def retire_settled(
    stream: PromptStream, rollout: Rollout, scored: ScoredRollout, rewards: TokenRewards, processes: Strategy
) -> dict[str, float]:
    """The per-prompt difficulty filter (`data.retire_settled_after`): tells `stream` which prompts of this batch
    were settled; `data/retired_prompts` (how many are out of play now) when the filter is on."""
    if not stream.retire_after or rewards.signal is None:
        return {}
    stream.record_settled(settled_prompts(rollout, rewards.signal, scored.valid, stream.batch_size, processes))
    return {"data/retired_prompts": float(len(stream.retired))}


def settled_prompts(
    rollout: Rollout, signal: RewardSignal, valid: torch.Tensor, num_prompts: int, processes: Strategy
) -> list[bool]:
    """For each prompt of the global batch (its position, the rollout's group id), whether it was settled: some of
    its responses were valid (`valid`, (B,) bool) and none carried a signal. A group never spans processes."""
    counts = torch.zeros(2, num_prompts, device=signal.rows.device)  # (2, prompts): valid rows, rows with a signal
    counts[0].index_add_(0, rollout.group_ids, valid.float())
    counts[1].index_add_(0, rollout.group_ids, signal.rows.float())
    counts = processes.process_sum_each(counts)
    return ((counts[0] > 0) & (counts[1] == 0)).tolist()


@dataclass
class KLReading:
    """A batch's KL to the reference, reduced once an iteration: the rewards, the KL controller and the metrics read
    this one (`read_kl`)."""

    per_token: torch.Tensor  # (B, T) `kl.estimator`'s, 0 past each response's end
    per_response: torch.Tensor  # (B,) summed over each response's policy tokens
    mean: float  # the mean per response over all processes: `objective/kl`, what the KL controller reads


def read_kl(rollout: Rollout, estimator: str, gather_mean: Callable[[torch.Tensor], float]) -> KLReading:
    """The batch's `KLReading`; `gather_mean`: the mean over every process's rows (`Strategy.gather_mean`)."""
    per_token = batch_kl(rollout, estimator)
    per_response = masked_sum(per_token, rollout.policy_mask, dim=1)
    return KLReading(per_token, per_response, gather_mean(per_response))


def batch_kl(rollout: Rollout, estimator: str) -> torch.Tensor:
    """(B, T) per-token KL to the reference (`kl.estimator`), 0 past each response's end; a `full_logits` estimator's
    (`exact`) was taken by the rollout, which held both models' logits."""
    if KL_ESTIMATORS.trait(estimator, "full_logits"):
        assert rollout.full_logits_kl is not None, f"kl.estimator `{estimator}`: the rollout holds its per-state KL"
        return rollout.full_logits_kl
    kl = KL_ESTIMATORS[estimator](rollout.logprobs, rollout.ref_logprobs)
    return torch.where(rollout.policy_mask, kl, torch.zeros_like(kl))


def token_rewards(
    rollout: Rollout,
    scored: ScoredRollout,
    cfg: Config,
    kl_coef: float,
    kl_reading: KLReading,
    signal: RewardSignal | None = None,
) -> TokenRewards:
    """Scores minus beta * KL per token (`kl.placement` reward / both; `kl_reading`: the batch's `read_kl`), the
    truncation policy's bootstrap and dropped samples; `signal` (`reward_signal`) travels with them to the
    advantages and the update."""
    mask = rollout.policy_mask
    kl = kl_reading.per_token
    beta = kl_coef if cfg.kl.placement in ("reward", "both") else 0.0
    # full logits (exact): a token's reward carries the KL of the state it leads into; its own state's is a loss term
    penalized = next_state_kl(kl, mask) if KL_ESTIMATORS.trait(cfg.kl.estimator, "full_logits") else kl
    rewards = kl_penalized_rewards(scored.token_scores, penalized, beta, mask)
    if cfg.reward.truncation == "bootstrap":
        rewards = bootstrap_truncated(rewards, mask, rollout.truncated, rollout.final_values, cfg.ppo.gamma)
    keep = scored.valid
    if cfg.reward.truncation == "drop":
        keep = keep & ~rollout.truncated
    return TokenRewards(rewards=rewards, kl_reading=kl_reading, train_mask=mask & keep[:, None], signal=signal)


def advantages(
    rollout: Rollout,
    rewards: TokenRewards,
    cfg: Config,
    whiten: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor],
    batch_std: Callable[[torch.Tensor], torch.Tensor] = population_std,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), each (B, T), by `ppo.advantage_estimator`; `whiten(values, mask, floor_values, floor)`:
    the strategy's whitening over all processes (`ppo.whiten_advantages`), over the tokens of rows with a signal,
    its scale at least `ppo.whiten_floor` x the std of the advantages the rewards give without a critic (the same
    estimator with every value 0). Rows without a signal get advantage 0 (their returns stay: a critic may learn
    from them). An estimator with the trait `group_scale` (`grpo`) gets `ppo.grpo_scale` and `batch_std(per-row
    (B,))`: the population std over every process's rows (`Strategy.gather_std`)."""
    p = cfg.ppo
    scaled = ADVANTAGE_ESTIMATORS.trait(p.advantage_estimator, "group_scale")
    estimate = partial(
        ADVANTAGE_ESTIMATORS[p.advantage_estimator],
        rewards.rewards,
        mask=rollout.policy_mask,
        gamma=p.gamma,
        lam=p.lam,
        group_ids=rollout.group_ids,
        **({"scale": p.grpo_scale, "batch_std": batch_std} if scaled else {}),
    )
    adv, returns = estimate(rollout.values)
    signal = rewards.signal
    if p.whiten_advantages:
        learn = rewards.train_mask if signal is None else rewards.train_mask & signal.rows[:, None]
        # what the rewards alone justify: a critic that explains the reward shrinks the advantages, and whitening
        # them to unit size would blow its errors up; they may shrink, never grow past this spread
        critic_free = estimate(torch.zeros_like(rollout.values))[0] if p.whiten_floor > 0 else None
        adv = whiten(adv, learn, critic_free, p.whiten_floor)
    if signal is not None:
        adv = torch.where(signal.rows[:, None], adv, torch.zeros_like(adv))
    return adv, returns
