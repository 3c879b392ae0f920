"""Advantage estimators: a registry with ONE signature; whitening is a separate step (`masking.masked_whiten`).

Signature: fn(rewards (B, T), values (B, T), mask (B, T) bool, *, gamma, lam, group_ids (B,) | None)
           -> (advantages (B, T), returns (B, T)), both 0 at masked positions.
The mask must be a prefix mask (real tokens first, then padding): the value after the last real token is 0
(a bootstrap, if wanted, is already in the last reward, see `core.rewards.bootstrap_truncated`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    def wrap(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn
    return wrap


@register_advantage_estimator("gae")
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float,
        group_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), vectorised over batch and time.

    delta_t = r_t + gamma * V_{t+1} - V_t  (V_{t+1} = 0 after the last real token)
    A_t = delta_t + gamma * lam * A_{t+1};  returns R_t = A_t + V_t.
    Naive equivalent: the same recursion in Python over each row's real tokens (see tests).
    """
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
