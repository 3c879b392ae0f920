"""Advantage estimators: a registry with ONE signature; whitening is a separate step (`masking.masked_whiten`).

Signature: fn(rewards (B, T), values (B, T), mask (B, T) bool, *, gamma, lam, group_ids (B,) | None)
           -> (advantages (B, T), returns (B, T)), both 0 at masked positions.
The mask selects the tokens the policy chose: a prefix mask for a single response (real tokens, then padding), or
an episode's action mask with the environment's observation spans False between the turns. Masked positions are
skipped, not stepped through: the recursion runs over the selected tokens as one sequence (veRL's multi-turn GAE),
so the last token of turn k bootstraps from the first token of turn k + 1 with one gamma, and inserting observation
tokens changes no advantage. The value after the last selected token is 0 (a bootstrap, if wanted, is already in
the last reward, see `core.rewards.bootstrap_truncated`). `turn_gae` runs the same recursion over the turns (the
runs of True) instead of the tokens.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, TypeVar

import torch

from lmppo.core.masking import compaction_order
from lmppo.registry import ADVANTAGE_ESTIMATORS


class AdvantageEstimator(Protocol):
    """The one signature of the registry (see the module docstring)."""

    def __call__(
        self,
        rewards: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        *,
        gamma: float,
        lam: float,
        group_ids: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


E = TypeVar("E", bound=AdvantageEstimator)


def register_advantage_estimator(name: str) -> Callable[[E], E]:
    """Add an estimator to `lmppo.registry.ADVANTAGE_ESTIMATORS` (a name taken twice is refused)."""
    return ADVANTAGE_ESTIMATORS.register(name)


@register_advantage_estimator("gae")
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    group_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), vectorised over batch and time.

    delta_t = r_t + gamma * V_{t+1} - V_t  (V_{t+1} = 0 after the last real token)
    A_t = delta_t + gamma * lam * A_{t+1};  returns R_t = A_t + V_t.
    t and t + 1 are consecutive *selected* tokens: an episode's observation tokens are squeezed out first
    (`masking.compaction_order`, the identity for a prefix mask) and the results put back in place.
    Naive equivalent: the same recursion in Python over each row's selected tokens (see tests).
    """
    order = compaction_order(mask)  # (B, T)
    packed = [x.gather(1, order) for x in (rewards, values)]
    packed_mask = mask.gather(1, order)  # (B, T) a prefix mask
    adv_packed, ret_packed = _gae_prefix(packed[0], packed[1], packed_mask, gamma, lam)
    advantages = torch.zeros_like(adv_packed).scatter(1, order, adv_packed)
    returns = torch.zeros_like(ret_packed).scatter(1, order, ret_packed)
    return advantages, returns


def _gae_prefix(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gae` over a prefix mask (B, T): every selected token is followed by the next one."""
    zeros = torch.zeros_like(values)
    values = torch.where(mask, values, zeros)
    rewards = torch.where(mask, rewards, zeros)
    next_values = torch.cat([values[:, 1:], zeros[:, :1]], dim=1)  # (B, T), 0 past the last real token
    deltas = rewards + gamma * next_values - values  # (B, T)
    # A_t = sum_{k >= t} (gamma * lam)^(k - t) * delta_k. Deltas are 0 after the last real token, so one
    # (T, T) upper-triangular discount matrix serves every row: a matmul instead of a Python loop over time.
    T = values.shape[1]
    steps = torch.arange(T, device=values.device)
    exponent = (steps[:, None] - steps[None, :]).to(values.dtype)  # [k, t] = k - t
    discount = torch.where(exponent >= 0, (gamma * lam) ** exponent.clamp(min=0), torch.zeros_like(exponent))
    advantages = deltas @ discount  # (B, T)
    advantages = torch.where(mask, advantages, zeros)
    returns = torch.where(mask, advantages + values, zeros)
    return advantages, returns


@register_advantage_estimator("turn_gae")
def turn_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    group_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over turns instead of tokens (turn-level credit, as in Turn-PPO and ArCHer's utterance-level critic).

    The turns are the maximal runs of True in `mask` (a single response: one turn). For turn k:
      R_k = the sum of its tokens' rewards (KL penalties included);  V_k = the value at its FIRST token (the state
      the policy acted from);  delta_k = R_k + gamma * V_{k+1} - V_k  (V after the last turn = 0);
      A_k = delta_k + gamma * lam * A_{k+1};  every token of turn k gets A_k and the return A_k + V_k.
    It equals `gae` when every turn is one token; with gamma = lam = 1 its returns at each turn's first token equal
    `gae`'s (the rewards still to come). Naive equivalent: the same recursion in Python over each row's turns.
    """
    zeros = torch.zeros_like(values)
    previous = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1)
    starts = mask & ~previous  # (B, T) the first token of each turn
    # turn index of every token (0-based); masked positions point at turn 0 and add zeros there
    turn = (starts.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T)
    # per-turn sequences, T wide (no row has more than T turns; T avoids reading the count on the host)
    turn_rewards = zeros.scatter_add(1, turn, torch.where(mask, rewards, zeros))  # (B, T) R_k
    turn_values = zeros.scatter_add(1, turn, torch.where(starts, values, zeros))  # (B, T) V_k
    turns = starts.sum(dim=1, keepdim=True)  # (B, 1)
    turn_mask = torch.arange(values.shape[1], device=values.device) < turns  # (B, T) a prefix mask over turns
    adv_turns, ret_turns = _gae_prefix(turn_rewards, turn_values, turn_mask, gamma, lam)
    advantages = torch.where(mask, adv_turns.gather(1, turn), zeros)
    returns = torch.where(mask, ret_turns.gather(1, turn), zeros)
    return advantages, returns


def _response_returns(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) total reward of each response (sum over its real tokens)."""
    return torch.where(mask, rewards, torch.zeros_like(rewards)).sum(dim=1)


def _returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """(B, T) G_t = sum_{s >= t} gamma^(s - t) r_s over real tokens: GAE with V = 0 and lambda = 1."""
    zeros = torch.zeros_like(rewards)
    return gae(rewards, zeros, mask, gamma=gamma, lam=1.0)[0]


def _group_stats(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group size, group mean and group std (population) of `values` (B,) grouped by `group_ids` (B,)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1
    count = torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(
        0, inverse, torch.ones_like(values)
    )
    total = torch.zeros_like(count).index_add_(0, inverse, values)
    mean = total / count
    sq = torch.zeros_like(count).index_add_(0, inverse, (values - mean[inverse]) ** 2)
    std = (sq / count).sqrt()
    return count[inverse], mean[inverse], std[inverse]


def _require_groups(group_ids: Optional[torch.Tensor], name: str) -> torch.Tensor:
    if group_ids is None:
        raise ValueError(f"advantage estimator {name!r} needs group_ids (rollout.num_samples_per_prompt > 1)")
    return group_ids


@register_advantage_estimator("rloo")
def rloo(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    group_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): A_i = R_i - mean of the other responses to the same
    prompt, R_i the response's total reward; the same advantage on every token of the response.
    Values are not used; returns are the per-token returns-to-go (for a value head, if one is trained)."""
    group_ids = _require_groups(group_ids, "rloo")
    totals = _response_returns(rewards, mask)
    count, mean, _ = _group_stats(totals, group_ids)
    if (count < 2).any():
        raise ValueError("rloo needs at least 2 responses per prompt")
    baseline = (mean * count - totals) / (count - 1)
    adv = (totals - baseline)[:, None].expand_as(rewards)
    zeros = torch.zeros_like(rewards)
    return torch.where(mask, adv, zeros), _returns_to_go(rewards, mask, gamma)


def population_std(values: torch.Tensor) -> torch.Tensor:
    """0-dim population std of `values` (B,): the spread of one process's rows (the default `batch_std` of `grpo`)."""
    return values.std(unbiased=False)


GroupScale = Callable[[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], torch.Tensor]
"""fn(totals (B,), group_std (B,), batch_std) -> (B,) what each row's group-centred score is divided by."""
GROUP_SCALES: dict[str, GroupScale] = {
    "group": lambda totals, group_std, batch_std: group_std + 1e-6,
    "batch": lambda totals, group_std, batch_std: (batch_std(totals) + 1e-6).expand_as(totals),
    "none": lambda totals, group_std, batch_std: torch.ones_like(totals),
}
"""`ppo.grpo_scale`: `group` (GRPO: the group's population std + 1e-6), `batch` (the population std of every
response total of the batch + 1e-6, TRL's `scale_rewards="batch"`), `none` (Dr. GRPO: centred only)."""


@register_advantage_estimator("grpo")
def grpo(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    group_ids: Optional[torch.Tensor] = None,
    scale: str = "group",
    batch_std: Callable[[torch.Tensor], torch.Tensor] = population_std,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-normalised outcome advantage (GRPO, Shao et al. 2024): A_i = (R_i - mean_g) / s_i on every token,
    R_i the response's total reward, mean_g its group's mean and s_i by `scale` (`GROUP_SCALES`, registry trait
    `group_scale`): `group` s_i = std_g + 1e-6 (std_g the population std of the group's totals), `batch` s_i =
    batch_std(R) + 1e-6 (`batch_std`: the population std of all totals, over every process when the trainer
    passes its gather), `none` s_i = 1 (Dr. GRPO, Liu et al. 2025). Values are not used."""
    group_ids = _require_groups(group_ids, "grpo")
    totals = _response_returns(rewards, mask)
    _, mean, std = _group_stats(totals, group_ids)
    adv = ((totals - mean) / GROUP_SCALES[scale](totals, std, batch_std))[:, None].expand_as(rewards)
    return torch.where(mask, adv, torch.zeros_like(rewards)), _returns_to_go(rewards, mask, gamma)


@register_advantage_estimator("reinforce_pp")
def reinforce_pp(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    group_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): the token-level discounted return-to-go of the KL-shaped rewards is the
    advantage; normalisation over the whole batch is the separate whitening step (`ppo.whiten_advantages`).
    Values are not used; no groups needed."""
    g = _returns_to_go(rewards, mask, gamma)
    return g, g
