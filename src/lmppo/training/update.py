"""Phase 5 of an iteration, the PPO epochs: minibatch order, a micro-batch's objective, the `ppo.target_kl` brake
and the non-finite guard of an optimizer step. The loop itself is `PPOTrainer.ppo_update`."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from lmppo.config import Config
from lmppo.core.batch import Rollout
from lmppo.core.kl import KL_ESTIMATORS
from lmppo.core.objective import STAT_NAMES, ppo_objective
from lmppo.errors import TrainingError
from lmppo.models.loading import PolicyOutput
from lmppo.training.metrics import MetricsAccumulator

if TYPE_CHECKING:
    from lmppo.distributed.strategy import Strategy


GRAD_NORM = "policy/grad_norm"
"""Each optimizer step's gradient norm before clipping (`checked_step`)."""
MEAN_STATS = (*STAT_NAMES.values(), GRAD_NORM)
"""The update's statistics that an iteration reports as their mean over its micro-batches (and processes): every
statistic of `ppo_objective` (`lmppo.core.objective.STAT_NAMES`, the one list of them) and the gradient norm."""


def minibatches(
    num_epochs: int, batch_size: int, minibatch_size: int, generator: torch.Generator, device: torch.device
) -> Iterator[tuple[int, torch.Tensor]]:
    """(epoch, this process's minibatch indices): a fresh random order of the batch every epoch."""
    for epoch in range(num_epochs):
        order = torch.randperm(batch_size, generator=generator).to(device)
        for start in range(0, batch_size, minibatch_size):
            yield epoch, order[start : start + minibatch_size]


def trim(batch: Rollout) -> tuple[Rollout, int]:
    """Drop prompt columns that are padding in every row and response columns past the longest response."""
    first_real = int(batch.prompt_mask.float().argmax(1).min().item()) if batch.prompt_mask.any() else 0
    keep = max(int(batch.response_mask.sum(1).max().item()), 1)
    return replace(
        batch,
        prompt_ids=batch.prompt_ids[:, first_real:],
        prompt_mask=batch.prompt_mask[:, first_real:],
        response_ids=batch.response_ids[:, :keep],
        response_mask=batch.response_mask[:, :keep],
        logprobs=batch.logprobs[:, :keep],
        ref_logprobs=batch.ref_logprobs[:, :keep],
        values=batch.values[:, :keep],
        ref_logits=None if batch.ref_logits is None else batch.ref_logits[:, :keep],
        exact_kl=None if batch.exact_kl is None else batch.exact_kl[:, :keep],
    ), keep


def loss_kl_estimator(cfg: Config) -> str | None:
    """The KL term of the loss: `kl.estimator` itself with either placement when it reads full logits (`exact`:
    the state's own KL is a loss term, `lmppo.core.kl.next_state_kl`), else `kl.loss_estimator` with placement
    loss / both, else None (no term)."""
    if KL_ESTIMATORS.trait(cfg.kl.estimator, "full_logits"):
        return cfg.kl.estimator
    return cfg.kl.loss_estimator if cfg.kl.placement in ("loss", "both") else None


def micro_batch_objective(
    batch: Rollout,
    forward: PolicyOutput,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: torch.Tensor,
    cfg: Config,
    kl_coef: float,
    stats: MetricsAccumulator,
) -> torch.Tensor:
    """`ppo_objective` of a trimmed micro-batch (`trim`), its statistics added to `stats`. `forward`: the policy's
    response logits and values, maybe wider than the batch (a reused rollout pass): cut to its width here."""
    keep = batch.response_ids.shape[1]
    assert forward.values is not None, "the micro-batch forward returns values"
    logits, values = forward.logits[:, :keep], forward.values[:, :keep]  # V(s_0) .. V(s_{keep-1})
    loss, objective_stats = ppo_objective(
        logits,
        values,
        batch.response_ids,
        batch.logprobs,
        batch.values,
        advantages,
        returns,
        mask,
        num_tokens,
        clip_range=cfg.ppo.clip_range,
        value_clip_range=cfg.ppo.value_clip_range,
        vf_coef=cfg.ppo.vf_coef,
        entropy_coef=cfg.ppo.entropy_coef,
        kl_coef=kl_coef,
        kl_estimator=loss_kl_estimator(cfg),
        ref_logprobs=batch.ref_logprobs,
        ref_logits=batch.ref_logits,
    )
    for name, value in objective_stats.items():
        stats.add(name, value)
    return loss


def went_too_far(stats: MetricsAccumulator, micro_batches: int, target_kl: float, strategy: Strategy) -> bool:
    """`ppo.target_kl`: after a minibatch's step, whether the approximate KL its forward measured (the policy
    after the steps before it, against the rollout policy) passed 1.5 x target_kl; every process decides alike."""
    if not target_kl:
        return False
    stats.add("ppo/updates", 1.0)
    approx_kl = strategy.process_mean(stats.recent_mean("policy/approxkl_avg", micro_batches))
    stopped = approx_kl > 1.5 * target_kl
    stats.add("ppo/early_stop", float(stopped))
    return stopped


def checked_step(
    optimizer: torch.optim.Optimizer,
    clip_grad_norm: Callable[[], float | torch.Tensor],
    loss: torch.Tensor,
    stats: MetricsAccumulator,
    nonfinite_in_a_row: int,
    max_nonfinite: int,
) -> int:
    """One optimizer step after gradient clipping (`clip_grad_norm()` -> the norm before clipping), skipped when
    the loss or the gradient is not finite; returns the count of skipped steps in a row. TrainingError when it
    reaches `max_nonfinite` (`ppo.max_nonfinite_updates`)."""
    grad_norm = torch.as_tensor(clip_grad_norm())
    if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        stats.add("update/skipped_nonfinite", 1.0)
        if nonfinite_in_a_row + 1 >= max_nonfinite:
            raise TrainingError(
                f"{nonfinite_in_a_row + 1} updates in a row had a non-finite loss or gradient "
                f"(loss {loss.item()}, grad norm {grad_norm.item()}); stopping. Lower "
                "ppo.learning_rate, check the reward scale, or use reward.clip."
            )
        return nonfinite_in_a_row + 1
    stats.add("update/skipped_nonfinite", 0.0)
    stats.add(GRAD_NORM, grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return 0
