"""The reward model's loss on preference pairs (Bradley & Terry 1952, as in Stiennon et al. 2020 and Ouyang et al.
2022): P(chosen preferred) = sigmoid(r_chosen - r_rejected), trained by its negative log-likelihood."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """mean over pairs of -log sigmoid(r_chosen - r_rejected); `chosen`, `rejected`: (N,) scores -> scalar."""
    return -F.logsigmoid(chosen - rejected).mean()


def pair_accuracy_and_margin(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[float, float]:
    """(share of pairs the model orders right, a tie counting one half; mean of r_chosen - r_rejected), from (N,)
    scores."""
    diff = (chosen - rejected).float()  # (N,)
    right = (diff > 0).float() + 0.5 * (diff == 0).float()  # (N,)
    return float(right.mean()), float(diff.mean())
