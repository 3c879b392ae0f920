"""KL estimators (a registry); the KL coefficient controllers are in `lmppo.core.kl_control`.

Per-token estimators of KL(pi || pi_ref) from the log-probabilities of the *sampled* token
(Schulman, "Approximating KL divergence", 2020). With log r = log pi_ref - log pi:
  k1 = -log r              unbiased, can be negative per token
  k2 = (log r)^2 / 2       biased, low variance, never negative
  k3 = (r - 1) - log r     unbiased, never negative
`exact` is KL(pi || pi_ref) of each next-token distribution over the vocabulary, the per-token value every
estimator above estimates; it reads both models' whole next-token distributions, so it is registered with the trait
`full_logits` (`lmppo.registry.KL_ESTIMATORS`: it takes `(logits, ref_logits)`, and the rollout keeps the reference's
logits for the loss).
"""

from __future__ import annotations

from typing import Callable

import torch

from lmppo.registry import KL_ESTIMATORS

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def register_kl_estimator(name: str) -> Callable[[KLEstimator], KLEstimator]:
    """Add an estimator to `lmppo.registry.KL_ESTIMATORS` (a name taken twice is refused)."""
    return KL_ESTIMATORS.register(name)


@register_kl_estimator("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """(B, T) log pi - log pi_ref."""
    return logprobs - ref_logprobs


@register_kl_estimator("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """(B, T) 0.5 * (log pi - log pi_ref)^2."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@register_kl_estimator("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """(B, T) (r - 1) - log r with r = pi_ref / pi."""
    log_r = ref_logprobs - logprobs
    return torch.expm1(log_r) - log_r


def exact_kl(logits: torch.Tensor, ref_logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """(...) KL(p || p_ref) of each next-token distribution, summed over the whole vocabulary: the expectation of
    k1 over the token, not a one-sample estimate of it. logits, ref_logits: (..., V), computed in fp32.
    `chunk_size` (without gradients): rows at a time (`in_row_chunks`)."""
    if chunk_size is not None:
        return in_row_chunks(exact_kl, logits, ref_logits, chunk_size)
    logp = torch.log_softmax(logits.float(), dim=-1)
    logq = torch.log_softmax(ref_logits.float(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def in_row_chunks(
    full_logits_kl: KLEstimator, logits: torch.Tensor, ref_logits: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """(...) fp32 `full_logits_kl(logits, ref_logits)` of (..., V) inputs, `chunk_size` rows at a time (without
    gradients), so only (chunk, V) blocks of its fp32 temporaries exist at once."""
    flat, ref_flat = logits.reshape(-1, logits.shape[-1]), ref_logits.reshape(-1, ref_logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        out[start : start + chunk_size] = full_logits_kl(
            flat[start : start + chunk_size], ref_flat[start : start + chunk_size]
        )
    return out.reshape(logits.shape[:-1])


def next_state_kl(kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) the exact KL of the state each token leads into: out[:, t] = kl[:, t + 1] where token t + 1 is a real
    response token, else 0. As a per-token penalty in the rewards this is the part of the response's KL that token
    t's choice decides; the KL of the state it is chosen in (kl[:, t]) reaches the policy as a loss term instead,
    and the two together give the exact gradient of the response's KL (`kl.estimator: exact`, or any estimator with
    the trait `full_logits`: its value is the state's, not the sampled token's)."""
    shifted = torch.zeros_like(kl)
    shifted[:, :-1] = torch.where(mask[:, 1:], kl[:, 1:], torch.zeros_like(kl[:, 1:]))
    return torch.where(mask, shifted, torch.zeros_like(shifted))
