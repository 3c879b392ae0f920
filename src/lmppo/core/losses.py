"""PPO losses as per-token tensors, and their aggregation.

Losses return a per-token loss (B, T) plus a dict of per-token statistics; `token_mean` aggregates with a
denominator fixed for the whole minibatch, so the gradient is the same whatever the micro-batch split
(a per-micro-batch mean would weight short micro-batches' tokens more).
"""

from __future__ import annotations

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
