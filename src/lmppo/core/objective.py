"""The PPO objective of one micro-batch, as one pure function: clipped policy loss, clipped value loss, entropy
bonus and the KL term of the loss, their token mean, and the statistics the trainer logs.

    loss_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps, 1 + eps))                     policy (Schulman et al. 2017)
           + vf_coef * 0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2)                value, V_clip = V_old +- c
           - entropy_coef * H(pi(.|s_t))                                           entropy bonus
           + kl_coef * kl_t                                                        `kl.placement` loss / both
    loss = sum over the micro-batch's real tokens of loss_t / (real tokens of the whole minibatch)

Summed over micro-batches this is the minibatch's token mean, whatever the split (`lmppo.core.losses.token_mean`).
`aggregation` (`lmppo.core.losses.LOSS_AGGREGATIONS`, `ppo.loss_aggregation`) may weigh the tokens otherwise
(`sequence_mean`: each sequence's token mean, then their mean; `fixed_length`: the token sum over sequences x the
longest response allowed); it applies to loss_t whole, all four terms alike: the policy loss, and with it the
value loss (0 with a critic-free estimator), the entropy bonus and the KL term of the loss, as TRL's GRPOTrainer
aggregates its KL term with its policy loss. Every aggregation keeps the sum over micro-batches the same whatever
the split.
"""

from __future__ import annotations

from typing import Optional

import torch

from lmppo.core.kl import KL_ESTIMATORS
from lmppo.core.logprobs import entropy_from_logits, selective_log_softmax
from lmppo.core.losses import LOSS_AGGREGATIONS, clipped_policy_loss, clipped_value_loss
from lmppo.core.masking import masked_mean

STAT_NAMES = {
    "kl": "loss/kl_avg",
    "policy": "loss/policy_avg",
    "value": "loss/value_avg",
    "policy_clipped": "policy/clipfrac_avg",
    "value_clipped": "val/clipfrac_avg",
    "approx_kl": "policy/approxkl_avg",
    "entropy": "policy/entropy_avg",
    "ratio": "val/ratio",
}
"""The names of the statistics `ppo_objective` returns (TRL's names and meanings)."""


def ppo_objective(
    logits: torch.Tensor,
    values: torch.Tensor,
    response_ids: torch.Tensor,
    old_logprobs: torch.Tensor,
    old_values: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    denominator: torch.Tensor | float,
    *,
    clip_range: float,
    value_clip_range: float,
    vf_coef: float,
    entropy_coef: float,
    kl_coef: float = 0.0,
    kl_estimator: Optional[str] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    ref_logits: Optional[torch.Tensor] = None,
    aggregation: str = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the minibatch loss (a scalar with the graph) and its statistics.

    logits (B, T, V): the current policy at the response positions; values (B, T): V(s_t) now; response_ids (B, T);
    old_logprobs, old_values (B, T): the rollout's; advantages, returns (B, T); mask (B, T) bool: the tokens that
    train; denominator: the whole minibatch's denominator of `aggregation` (`LossAggregation.denominator`; for
    `token_mean`, its real tokens). `kl_estimator`: None (no KL term in the loss) or a name of
    `lmppo.core.kl.KL_ESTIMATORS`: one with the trait `full_logits` (`exact`) needs ref_logits (B, T, V), the others
    ref_logprobs (B, T).
    Statistics: name of `STAT_NAMES` -> the masked mean over the micro-batch's tokens (0-dim, no graph); `loss/kl_avg`
    only with a KL term. Values at positions outside `mask` never change a result.
    """
    logprobs = selective_log_softmax(logits, response_ids)  # (B, T) log pi(a_t|s_t)
    pg_loss, pg_stats = clipped_policy_loss(logprobs, old_logprobs, advantages, clip_range)
    vf_loss, vf_stats = clipped_value_loss(values, old_values, returns, value_clip_range)
    per_token = pg_loss + vf_coef * vf_loss
    if entropy_coef > 0:
        entropy = entropy_from_logits(logits)
        per_token = per_token - entropy_coef * entropy
    else:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())
    stats: dict[str, torch.Tensor] = {}
    if kl_estimator is not None:
        estimator = KL_ESTIMATORS[kl_estimator]
        if KL_ESTIMATORS.trait(kl_estimator, "full_logits"):  # the KL of the state each token is chosen in
            assert ref_logits is not None, f"kl_estimator `{kl_estimator}` (full_logits) needs ref_logits"
            kl_term = estimator(logits, ref_logits)
        else:
            kl_term = estimator(logprobs, ref_logprobs)
        per_token = per_token + kl_coef * kl_term
        stats[STAT_NAMES["kl"]] = masked_mean(kl_term.detach(), mask)
    for key, value in (
        ("policy", pg_loss),
        ("value", vf_loss),
        ("policy_clipped", pg_stats["clipped"]),
        ("value_clipped", vf_stats["clipped"]),
        ("approx_kl", pg_stats["approx_kl"]),
        ("entropy", entropy),
        ("ratio", pg_stats["ratio"]),
    ):
        stats[STAT_NAMES[key]] = masked_mean(value.detach(), mask)
    return LOSS_AGGREGATIONS[aggregation].share(per_token, mask, denominator), stats
