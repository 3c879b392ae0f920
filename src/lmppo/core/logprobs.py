"""Log-probabilities of chosen tokens and entropies, from logits."""

from __future__ import annotations

import torch


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits, -1) gathered at `index`, without materialising the full log-softmax.

    Equivalent to ``torch.log_softmax(logits, -1).gather(-1, index[..., None]).squeeze(-1)``.
    logits: (..., V) float; index: (...) long -> (...) in float32 (bf16 logits are upcast first:
    log-softmax in bf16 loses about 2 significant digits, which shows up directly in the PPO ratio).
    """
    logits = logits.float()
    chosen = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(l) - sum(softmax(l) * l).

    logits: (B, T, V) -> (B, T) float32. Computed over chunks of rows so only a (chunk, V) block of
    probabilities exists at once; the naive equivalent is ``-(p * p.log()).sum(-1)`` with ``p = softmax(l)``.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        block = flat[start : start + chunk_size].float()
        probs = torch.softmax(block, dim=-1)
        out[start : start + chunk_size] = torch.logsumexp(block, dim=-1) - (probs * block).sum(-1)
    return out.reshape(logits.shape[:-1])
