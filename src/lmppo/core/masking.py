"""Masked statistics and response masks.

Masks are boolean tensors the shape of the values; positions where the mask is False never change a result.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is True (values at masked positions may be anything finite or not)."""
    zeros = torch.zeros_like(values)
    picked = torch.where(mask, values, zeros)
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over the positions where `mask` is True; 0 where nothing is selected."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all selected positions (Bessel-corrected when `unbiased` and more than one is selected)."""
    mean = masked_mean(values, mask)
    sq = masked_sum((values - mean) ** 2, mask)
    n = mask.sum()
    denom = (n - 1).clamp(min=1) if unbiased else n.clamp(min=1)
    return sq / denom


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / std over the selected positions; masked positions are returned as 0.

    With `shift_mean=False` the mean is added back (scale only), as for rewards in the N implementation details.
    """
    return whiten_with(values, mask, masked_mean(values, mask), masked_var(values, mask), shift_mean, eps)


def whiten_with(
    values: torch.Tensor,
    mask: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """`masked_whiten` with given statistics (e.g. computed over all processes)."""
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros_like(whitened))


def first_true_index(flags: torch.Tensor) -> torch.Tensor:
    """(B, T) bool -> (B,) long: index of the first True in each row, or T when the row has none."""
    T = flags.shape[-1]
    positions = torch.arange(T, device=flags.device).expand_as(flags)
    return torch.where(flags, positions, torch.full_like(positions, T)).min(dim=-1).values


def stop_token_mask(response_ids: torch.Tensor, stop_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Response mask and `terminated` flags from the first stop token of each response.

    response_ids: (B, T) long; stop_ids: (S,) long (empty: no stop token).
    Returns mask (B, T) bool (True up to and including the first stop token) and terminated (B,) bool.
    """
    is_stop = (
        torch.isin(response_ids, stop_ids) if stop_ids.numel() else torch.zeros_like(response_ids, dtype=torch.bool)
    )
    first = first_true_index(is_stop)  # (B,)
    T = response_ids.shape[-1]
    positions = torch.arange(T, device=response_ids.device)
    mask = positions[None, :] <= first[:, None]
    return mask, first < T


def last_true_index(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool prefix mask -> (B,) index of the last True (the last real response token); -1 if none."""
    return mask.long().sum(dim=-1) - 1
