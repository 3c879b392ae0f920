"""PPO losses as per-token tensors, and their aggregation.

Losses return a per-token loss (B, T) plus a dict of per-token statistics. An aggregation (`LOSS_AGGREGATIONS`,
`ppo.loss_aggregation`) turns them into a micro-batch's share of the minibatch loss with a denominator fixed for the
whole minibatch, so the gradient is the same whatever the micro-batch split (a per-micro-batch mean would weight
short micro-batches' tokens more): each row's weight depends on the row itself and on the minibatch's denominator
only, and every row lies whole in one micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from lmppo.core.masking import masked_sum


def clipped_policy_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017), per token, to be minimised.

    ratio = exp(logp - logp_old);  loss = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)).
    All (B, T). Stats (B, T): ratio, clipped (float 0/1: the clipped branch was taken), approx_kl
    (0.5 * (log ratio)^2, as TRL's `policy/approxkl_avg`).
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped)
    stats = {
        "ratio": ratio.detach(),
        "clipped": (clipped > unclipped).float().detach(),
        "approx_kl": (0.5 * log_ratio.detach() ** 2),
    }
    return loss, stats


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss, per token: 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, +-c).

    All (B, T). Stats: clipped (float 0/1: the clipped branch was larger).
    """
    values_clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    unclipped = (values - returns) ** 2
    clipped = (values_clipped - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped)
    return loss, {"clipped": (clipped > unclipped).float().detach()}


def token_mean(per_token: torch.Tensor, mask: torch.Tensor, num_tokens: torch.Tensor | float) -> torch.Tensor:
    """Sum of `per_token` over the real tokens of this micro-batch divided by the real-token count of the
    whole minibatch (`num_tokens`): summing this over micro-batches gives the minibatch token mean."""
    return masked_sum(per_token, mask) / num_tokens


def sequence_mean(per_token: torch.Tensor, mask: torch.Tensor, num_sequences: torch.Tensor | float) -> torch.Tensor:
    """Each row's token mean of `per_token` (B, T) over its real tokens (`mask`), summed over the micro-batch's rows
    and divided by the sequence count of the whole minibatch (`num_sequences`, rows with a real token): summed over
    micro-batches, the mean over sequences of each sequence's token mean (GRPO, Shao et al. 2024). A row without a
    real token adds 0."""
    per_row = masked_sum(per_token, mask, dim=1) / mask.sum(1).clamp(min=1)  # (B,)
    return per_row.sum() / num_sequences


def token_count(mask: torch.Tensor, max_length: int) -> torch.Tensor:
    """0-dim float: the real tokens of `mask` (B, T)."""
    return mask.sum().float()


def sequence_count(mask: torch.Tensor, max_length: int) -> torch.Tensor:
    """0-dim float: the rows of `mask` (B, T) with a real token."""
    return mask.any(1).sum().float()


def token_budget(mask: torch.Tensor, max_length: int) -> torch.Tensor:
    """0-dim float: the rows of `mask` (B, T) with a real token times `max_length` (the longest response allowed):
    the tokens they could have had, whatever they had."""
    return sequence_count(mask, max_length) * max_length


@dataclass(frozen=True)
class LossAggregation:
    """How per-token losses become the minibatch loss: `denominator(mask (B, T), max_length)` of this process's part
    of the minibatch (the trainer sums it over processes), then `share(per_token (B, T), mask, denominator)` of each
    micro-batch; the shares sum to the minibatch loss whatever the micro-batch split."""

    share: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | float], torch.Tensor]
    denominator: Callable[[torch.Tensor, int], torch.Tensor]


LOSS_AGGREGATIONS: dict[str, LossAggregation] = {
    "token_mean": LossAggregation(token_mean, token_count),
    "sequence_mean": LossAggregation(sequence_mean, sequence_count),
    "fixed_length": LossAggregation(token_mean, token_budget),
}
"""`ppo.loss_aggregation`: `token_mean` (sum over the minibatch's real tokens / their count; DAPO, TRL's `dapo`),
`sequence_mean` (each sequence's token mean, then the mean over sequences; GRPO's paper, TRL's `grpo`),
`fixed_length` (token sum / (sequences x rollout.max_new_tokens), a constant whatever the lengths; Dr. GRPO, TRL's
`dr_grpo`)."""
