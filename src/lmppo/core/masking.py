"""Masked statistics, response masks and the action mask of multi-turn episodes.

Masks are boolean tensors the shape of the values; positions where the mask is False never change a result.
An episode's response holds the policy's turns with the environment's observations between them; its action mask
is True on the policy's tokens only (`action_mask`), and a single-turn response is the case of one turn.
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


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8, min_std: float = 0.0
) -> torch.Tensor:
    """(values - mean) / max(std, min_std) over the selected positions; masked positions are returned as 0.

    With `shift_mean=False` the mean is added back (scale only), as for rewards in the N implementation details.
    `min_std` (`ppo.whiten_floor`): values whose spread is below it are not scaled up to unit size.
    """
    var = masked_var(values, mask)
    return whiten_with(values, mask, masked_mean(values, mask), var, shift_mean, eps, min_std)


def whiten_with(
    values: torch.Tensor,
    mask: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    min_std: float = 0.0,
) -> torch.Tensor:
    """`masked_whiten` with given statistics (e.g. computed over all processes)."""
    whitened = (values - mean) * torch.rsqrt(var.clamp(min=min_std**2) + eps)
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
    """(B, T) bool -> (B,) index of the last True (the last real response token, or an episode's last policy
    token); -1 if none. For a prefix mask this is its length - 1."""
    T = mask.shape[-1]
    positions = torch.arange(T, device=mask.device).expand_as(mask)
    return torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=-1).values


def action_mask(turn_starts: torch.Tensor, turn_ends: torch.Tensor, width: int) -> torch.Tensor:
    """(B, T=width) bool, True on the policy's tokens of each episode: the union of its turns' spans.

    turn_starts, turn_ends: (B, K) long, the first and last response position of each policy turn (inclusive);
    -1 in both for the turns a row does not have. Every other position (observations, chat-template glue between
    turns, padding) is False: context only, never trained on."""
    positions = torch.arange(width, device=turn_starts.device)  # (T,)
    inside = (positions[None, None, :] >= turn_starts[:, :, None]) & (positions[None, None, :] <= turn_ends[:, :, None])
    return (inside & (turn_starts[:, :, None] >= 0)).any(dim=1)


def compaction_order(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool -> (B, T) long permutation of each row: the selected positions first, in order, then the rest.

    Gathering with it squeezes out unselected positions (an episode's observation tokens), so a recursion over time
    sees the policy's tokens as one unbroken sequence; scattering with it puts results back where they came from.
    For a prefix mask it is the identity."""
    return torch.sort((~mask).long(), dim=-1, stable=True).indices
