"""The reward model's loss on preference pairs (Bradley & Terry 1952, as in Stiennon et al. 2020 and Ouyang et al.
2022): P(chosen preferred) = sigmoid(r_chosen - r_rejected), trained by its negative log-likelihood."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: Optional[torch.Tensor] = None,
    center_coefficient: float = 0.0,
) -> torch.Tensor:
    """mean over pairs of -log sigmoid(r_chosen - r_rejected - margin), plus center_coefficient x the mean of
    (r_chosen + r_rejected)^2, as TRL's RewardTrainer computes it (its `margin` column and its
    `center_rewards_coefficient`); `chosen`, `rejected`, `margin`: (N,) -> scalar. No margin: 0 for every pair."""
    diff = chosen - rejected  # (N,)
    if margin is not None:
        diff = diff - margin.to(diff.dtype)
    loss = -F.logsigmoid(diff).mean()
    if center_coefficient:
        loss = loss + center_coefficient * torch.mean((chosen + rejected) ** 2)
    return loss


def pair_accuracy_and_margin(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[float, float]:
    """(share of pairs the model orders right, a tie counting one half; mean of r_chosen - r_rejected), from (N,)
    scores."""
    diff = (chosen - rejected).float()  # (N,)
    right = (diff > 0).float() + 0.5 * (diff == 0).float()  # (N,)
    return float(right.mean()), float(diff.mean())


def pearson_correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson's r of two (N,) series: cov(x, y) / (std(x) std(y)); nan when either is constant or N < 2. The
    reward model's length-bias check: r of held-out scores with the texts' token counts."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()  # (N,), (N,)
    denominator = float((x.square().sum() * y.square().sum()).sqrt())
    return float((x * y).sum()) / denominator if denominator > 0 else float("nan")
