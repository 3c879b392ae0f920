"""Per-token rewards from placed scores, the KL penalty and the truncation policy.

The score of a response sits on its last real token (the stop token when there is one), never on a
padding slot; finer-grained scores (per token, per span) are placed before they reach this module
(`lmppo.rewards.placement`). All functions take (B, T) tensors indexed by response token.
"""

from __future__ import annotations

import torch

from lmppo.core.masking import last_true_index


def kl_penalized_rewards(
    token_scores: torch.Tensor, kl: torch.Tensor, kl_coef: float, mask: torch.Tensor
) -> torch.Tensor:
    """rewards[t] = token_scores[t] - kl_coef * kl[t] on real tokens, 0 elsewhere.  All (B, T)."""
    rewards = token_scores - kl_coef * kl
    return torch.where(mask, rewards, torch.zeros_like(rewards))


def place_turn_rewards(turn_ends: torch.Tensor, turn_rewards: torch.Tensor, width: int) -> torch.Tensor:
    """(B, T=width) the rewards an environment gave each turn of an episode, each on its turn's last policy token.

    turn_ends: (B, K) long, the response position of each turn's last policy token, -1 for the turns a row does not
    have; turn_rewards: (B, K), ignored where turn_ends is -1. The reward of step k answers the action of turn k, so
    it sits where that action ended, never on the observation that follows it."""
    present = turn_ends >= 0
    rewards = torch.zeros(turn_ends.shape[0], width, dtype=turn_rewards.dtype, device=turn_rewards.device)
    amounts = torch.where(present, turn_rewards, torch.zeros_like(turn_rewards))
    return rewards.scatter_add_(1, turn_ends.clamp(min=0), amounts)


def _add_at_last(rewards: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, amount: torch.Tensor) -> torch.Tensor:
    """Add `amount` (B,) to the last token of `mask` (an episode's: its last policy token) of the rows where `rows`
    (B,) is True."""
    last = last_true_index(mask).clamp(min=0)  # (B,)
    add = torch.zeros_like(rewards)
    add.scatter_(1, last[:, None], torch.where(rows, amount, torch.zeros_like(amount))[:, None].to(rewards.dtype))
    return rewards + add


def penalize_truncated(
    token_scores: torch.Tensor, mask: torch.Tensor, truncated: torch.Tensor, penalty: float, mode: str
) -> torch.Tensor:
    """The EOS trick on placed scores (B, T): for truncated rows, `replace` every score of the row by `penalty`
    on its last token, or `add` `penalty` to the last token."""
    if mode == "replace":
        token_scores = torch.where(truncated[:, None], torch.zeros_like(token_scores), token_scores)
    elif mode != "add":
        raise ValueError(f"penalty mode must be 'replace' or 'add', got {mode!r}")
    amount = torch.full(truncated.shape, penalty, dtype=token_scores.dtype, device=token_scores.device)
    return _add_at_last(token_scores, mask, truncated, amount)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025), (B,) from response lengths (B,) in tokens: 0 up to
    L_max - buffer, then falling linearly to -penalty at L_max: -penalty * (L - (L_max - buffer)) / buffer.
    `buffer` 0: all 0."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    excess = (lengths.float() - (max_length - buffer)).clamp(min=0)
    return -penalty * excess / buffer


def add_on_last_token(token_scores: torch.Tensor, mask: torch.Tensor, amount: torch.Tensor) -> torch.Tensor:
    """`amount` (B,) added to each row's last token of `mask` (B, T) in `token_scores` (B, T)."""
    return _add_at_last(token_scores, mask, torch.ones_like(amount, dtype=torch.bool), amount)


def unfinished_scores(
    token_scores: torch.Tensor,
    placed: torch.Tensor,
    mask: torch.Tensor,
    truncated: torch.Tensor,
    final_scores: torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    """For bootstrap: a cut response did not finish, so what judges it as a finished response is not a reward it
    received. Rows where `truncated` (B,) is True keep only their per-token and span scores: the placed scores
    `placed` (B, T) without `final_scores` (B,) (the scalar outputs, which sit on the last real token), divided by
    `scale` as normalisation divides them; any normalisation shift or clipping correction on their last token goes
    too. Other rows keep `token_scores` (B, T).

    Keeping a cut response's scalar score and adding gamma * V(s_T) as well counts its ending twice: V(s_T)
    estimates the score still to come, and with gamma = 1 the value function then inflates without bound (about
    +0.35 per iteration in benchmarks/learning/truncation_policies.py: V(s_0) 7.6 after 30 iterations, for returns
    near 2).
    """
    own = _add_at_last(placed, mask, truncated, -final_scores) / max(scale, 1e-8)
    return torch.where(truncated[:, None], own, token_scores)


def bootstrap_truncated(
    rewards: torch.Tensor, mask: torch.Tensor, truncated: torch.Tensor, final_values: torch.Tensor, gamma: float
) -> torch.Tensor:
    """For truncated rows, add gamma * V(s_T) to the last real token's reward (TRL PR #1536); take their
    whole-response scores off first (`unfinished_scores`).

    rewards (B, T); final_values (B,) = V of the state after the last generated token. GAE then sees
    delta_{T-1} = r_{T-1} + gamma * V(s_T) - V(s_{T-1}), as if the episode went on.
    """
    return _add_at_last(rewards, mask, truncated, gamma * final_values)


class RunningMoments:
    """Running mean and standard deviation of scores (Chan et al. parallel update), for score normalisation."""

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 0

    def update(self, values: torch.Tensor) -> None:
        n = values.numel()
        if n == 0:
            return
        batch_mean = values.float().mean().item()
        batch_var = values.float().var(unbiased=False).item() if n > 1 else 0.0
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean, self.var, self.count = self.mean + delta * n / total, m2 / total, total

    @property
    def std(self) -> float:
        return max(self.var, 0.0) ** 0.5

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]


def normalize_scores(
    token_scores: torch.Tensor, mask: torch.Tensor, mean: float, std: float, clip: float = 0.0
) -> torch.Tensor:
    """Scale placed scores (B, T) so each response's total becomes (total - mean) / std, optionally clipped to
    [-clip, clip]: every token score is divided by std and -mean/std (plus any clipping correction) lands on
    the last real token."""
    std = max(std, 1e-8)
    totals = token_scores.sum(1)  # (B,)
    target = (totals - mean) / std
    if clip > 0:
        target = target.clamp(-clip, clip)
    scaled = token_scores / std
    return _add_at_last(scaled, mask, torch.ones_like(totals, dtype=torch.bool), target - scaled.sum(1))


def score_range(
    scores: torch.Tensor, valid: torch.Tensor, group_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The highest and the lowest valid score each row is compared with: its group's (several responses to one
    prompt, `group_ids` (B,)) or, without groups, the whole batch's. scores (B,) per-response totals, valid (B,)
    bool. Returns (highest, lowest), each (B,); +-inf swapped (highest -inf, lowest +inf) where nothing is valid.
    Two values, not a pair type: the caller reduces each over processes on its own (max of highest, min of lowest)."""
    neg, pos = torch.full_like(scores, -float("inf")), torch.full_like(scores, float("inf"))
    high_in, low_in = torch.where(valid, scores, neg), torch.where(valid, scores, pos)
    if group_ids is None:
        return high_in.max().expand_as(scores), low_in.min().expand_as(scores)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n = int(inverse.max().item()) + 1 if inverse.numel() else 0
    high = torch.full((n,), -float("inf"), dtype=scores.dtype, device=scores.device)
    low = torch.full((n,), float("inf"), dtype=scores.dtype, device=scores.device)
    high = high.scatter_reduce(0, inverse, high_in, reduce="amax")
    low = low.scatter_reduce(0, inverse, low_in, reduce="amin")
    return high[inverse], low[inverse]


def signal_rows(highest: torch.Tensor, lowest: torch.Tensor, valid: torch.Tensor, tolerance: float) -> torch.Tensor:
    """(B,) bool: the valid rows whose comparison scores (`score_range`) spread by more than `tolerance`. A row
    whose group (or batch) all scored within `tolerance` of each other says nothing about which response is better:
    any step taken from it follows noise (a critic's errors, whitened to unit size), not the reward."""
    return valid & (highest - lowest > tolerance)
