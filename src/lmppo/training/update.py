"""Phase 5 of an iteration, the PPO epochs: minibatch order, the rows gathered once per epoch, micro-batch widths
taken on the host, a micro-batch's objective, the `ppo.target_kl` brake and the non-finite guard of an optimizer
step. The object that runs them and keeps their state is `lmppo.training.updater.Updater`."""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

import torch

from lmppo.config import Config
from lmppo.core.advantages import ADVANTAGE_ESTIMATORS
from lmppo.core.kl import KL_ESTIMATORS
from lmppo.core.losses import LOSS_AGGREGATIONS, clipped_value_loss
from lmppo.core.masking import masked_mean
from lmppo.core.objective import STAT_NAMES, ppo_objective
from lmppo.errors import TrainingError
from lmppo.models.loading import PolicyOutput
from lmppo.training.batch import Rollout
from lmppo.training.metrics import MetricsAccumulator

if TYPE_CHECKING:
    from lmppo.distributed.strategy import Strategy


WIDTH_BUCKETS = 4
"""Compiled update (`ppo.compile`): each micro-batch width is rounded up to one of this many fixed widths per
axis, so a run compiles (and captures) a few shapes only."""
GRAD_NORM = "policy/grad_norm"
"""Each optimizer step's gradient norm before clipping (`NonfiniteGuard.step`)."""
MEAN_STATS = (*STAT_NAMES.values(), GRAD_NORM)
"""The update's statistics that an iteration reports as their mean over its micro-batches (and processes): every
statistic of `ppo_objective` (`lmppo.core.objective.STAT_NAMES`, the one list of them) and the gradient norm."""


def epoch_orders(num_epochs: int, batch_size: int, generator: torch.Generator) -> Iterator[tuple[int, list[int]]]:
    """(epoch, this process's rows in a fresh random order): drawn on the host (the generator is a CPU one), so
    the minibatch loop never reads a device tensor to know its rows."""
    for epoch in range(num_epochs):
        yield epoch, torch.randperm(batch_size, generator=generator).tolist()


@dataclass
class UpdateBatch:
    """What the PPO epochs read: the rollout and its advantages, returns and training mask, (B, T) each."""

    rollout: Rollout
    advantages: torch.Tensor  # (B, T)
    returns: torch.Tensor  # (B, T)
    train_mask: torch.Tensor  # (B, T) bool, the tokens that train
    index: Optional[torch.Tensor] = None  # (B,) long on the device: the rows of the rollout these are (None: all)

    def shuffled(self, order: list[int]) -> UpdateBatch:
        """The rows in `order` (an epoch's order): one copy of the index to the device for every field."""
        index = torch.as_tensor(order, dtype=torch.long).to(self.advantages.device)
        return UpdateBatch(
            self.rollout.select(order, device_index=index),
            self.advantages[index],
            self.returns[index],
            self.train_mask[index],
            index,
        )

    def rows(self, start: int, stop: int) -> UpdateBatch:
        """Rows start .. stop - 1 as views (a minibatch or a micro-batch of a shuffled batch)."""
        return UpdateBatch(
            self.rollout.rows(start, stop),
            self.advantages[start:stop],
            self.returns[start:stop],
            self.train_mask[start:stop],
            None if self.index is None else self.index[start:stop],
        )


@dataclass(frozen=True)
class RowWidths:
    """Each row's prompt and response extent, read from the device once per iteration (`row_widths`), so every
    micro-batch's widths are taken on the host."""

    prompt_width: int  # P, the rollout's prompt columns
    response_width: int  # T, the rollout's response columns
    first_prompt_column: list[int]  # B, the first real prompt column (0 for a row without one)
    prompt_tokens: list[int]  # B, real prompt tokens
    response_lengths: list[int]  # B, real response tokens

    def micro_batch(self, rows: Sequence[int], buckets: int = 0) -> TrimWidths:
        """The widths of the micro-batch of rollout rows `rows`: prompt columns from the first real one of any row,
        response columns up to the longest response. `buckets` > 0: both widths rounded up to one of `buckets`
        fixed widths (multiples of 1/buckets of the rollout's width), so that a compiled update meets a few
        shapes only; 0: exact (eager)."""
        first = min(self.first_prompt_column[i] for i in rows)
        longest = max(max(self.response_lengths[i] for i in rows), 1)
        if buckets:
            first = self.prompt_width - _round_up(self.prompt_width - first, self.prompt_width, buckets)
            longest = _round_up(longest, self.response_width, buckets)
        padded = any(
            self.prompt_tokens[i] != self.prompt_width - first or self.response_lengths[i] != longest for i in rows
        )
        return TrimWidths(first, longest, padded)


def _round_up(width: int, full: int, buckets: int) -> int:
    """`width` rounded up to the next multiple of ceil(full / buckets), at most `full`."""
    step = max(-(-full // buckets), 1)
    return min(-(-width // step) * step, full)


def row_widths(batch: Rollout) -> RowWidths:
    """`RowWidths` of the rollout: one read of the device (three (B,) tensors copied together)."""
    prompt, response = batch.prompt_mask, batch.response_mask
    first, tokens, lengths = torch.stack(
        [prompt.float().argmax(1).long(), prompt.sum(1), response.sum(1)]
    ).tolist()  # (3, B)
    return RowWidths(prompt.shape[1], response.shape[1], first, tokens, lengths)


@dataclass(frozen=True)
class TrimWidths:
    """A micro-batch's columns: prompt from `first_prompt_column`, response up to `response_width`;
    `padded`: whether any kept position is padding (else the attention needs no mask beyond the causal one)."""

    first_prompt_column: int
    response_width: int
    padded: bool = True


def trim(batch: Rollout, widths: Optional[TrimWidths] = None) -> tuple[Rollout, int]:
    """Drop prompt columns that are padding in every row and response columns past the longest response.
    `widths`: taken on the host (`RowWidths.micro_batch`); None: read from the batch (a host sync)."""
    if widths is None:
        first_real = int(batch.prompt_mask.float().argmax(1).min().item()) if batch.prompt_mask.any() else 0
        widths = TrimWidths(first_real, max(int(batch.response_mask.sum(1).max().item()), 1))
    first_real, keep = widths.first_prompt_column, widths.response_width
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
        full_logits_kl=None if batch.full_logits_kl is None else batch.full_logits_kl[:, :keep],
        action_mask=batch.action_mask[:, :keep],
    ), keep


def loss_kl_estimator(cfg: Config) -> str | None:
    """The KL term of the loss: `kl.estimator` itself with either placement when it reads full logits (`exact`:
    the state's own KL is a loss term, `lmppo.core.kl.next_state_kl`), else `kl.loss_estimator` with placement
    loss / both, else None (no term)."""
    if KL_ESTIMATORS.trait(cfg.kl.estimator, "full_logits"):
        return cfg.kl.estimator
    return cfg.kl.loss_estimator if cfg.kl.placement in ("loss", "both") else None


def objective_and_stats(
    batch: Rollout,
    forward: PolicyOutput,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    denominator: torch.Tensor,
    cfg: Config,
    kl_coef: float | torch.Tensor,
    pull_only: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`ppo_objective` of a trimmed micro-batch (`trim`): the loss and its statistics. `forward`: the policy's
    response logits and values, maybe wider than the batch (a reused rollout pass): cut to its width here.
    `pull_only` (`kl.pull_without_signal`, a batch without reward signal, its advantages 0): only the KL term moves
    the policy: no entropy bonus, and a shared head's value loss is left out, since it would move the trunk."""
    keep = batch.response_ids.shape[1]
    assert forward.values is not None, "the micro-batch forward returns values"
    logits, values = forward.logits[:, :keep], forward.values[:, :keep]  # V(s_0) .. V(s_{keep-1})
    return ppo_objective(
        logits,
        values,
        batch.response_ids,
        batch.logprobs,
        batch.values,
        advantages,
        returns,
        mask,
        denominator,
        clip_range=cfg.ppo.clip_range,
        value_clip_range=cfg.ppo.value_clip_range,
        vf_coef=0.0 if pull_only and cfg.value.mode == "shared" else value_coef(cfg),
        entropy_coef=0.0 if pull_only else cfg.ppo.entropy_coef,
        kl_coef=kl_coef,  # type: ignore[arg-type]  # a 0-dim tensor when compiled (no recompile when beta moves)
        kl_estimator=loss_kl_estimator(cfg),
        ref_logprobs=batch.ref_logprobs,
        ref_logits=batch.ref_logits,
        aggregation=cfg.ppo.loss_aggregation,
    )


def minibatch_denominator(train_mask: torch.Tensor, cfg: Config) -> torch.Tensor:
    """0-dim: this process's share of the minibatch's denominator of `ppo.loss_aggregation` (`train_mask` (B, T) its
    rows' training tokens): its tokens, its sequences, or its sequences x `rollout.max_new_tokens`."""
    return LOSS_AGGREGATIONS[cfg.ppo.loss_aggregation].denominator(train_mask, cfg.rollout.max_new_tokens)


def value_coef(cfg: Config) -> float:
    """`ppo.vf_coef`, or 0 with an advantage estimator that reads no values (trait `uses_values`): a value function
    nobody reads is not trained, and a shared head's value loss would move the policy's trunk for nothing."""
    uses_values = ADVANTAGE_ESTIMATORS.trait(cfg.ppo.advantage_estimator, "uses_values")
    return cfg.ppo.vf_coef if uses_values else 0.0


def critic_only_loss(
    critic: torch.nn.Module | None,
    autocast: Callable[[], AbstractContextManager],
    cfg: Config,
    part: UpdateBatch,
    denominator: torch.Tensor,
    stats: MetricsAccumulator,
    widths: Optional[TrimWidths] = None,
) -> torch.Tensor:
    """A separate critic's share of the minibatch loss alone (vf_coef x clipped value loss), for a batch without a
    reward signal: no policy pass, so the policy's parameters get no gradient and the optimizer leaves them and
    their Adam moments as they are. Aggregated by ppo.loss_aggregation; `autocast`: the run's precision."""
    assert critic is not None, "value-only steps need a separate critic (value.mode critic)"
    batch, keep = trim(part.rollout, widths)
    _, loss = critic_value_loss(
        critic, autocast, cfg, batch, part.returns[:, :keep], part.train_mask[:, :keep], denominator, stats, widths
    )
    return loss


def critic_value_loss(
    critic: torch.nn.Module,
    autocast: Callable[[], AbstractContextManager],
    cfg: Config,
    batch: Rollout,
    returns: torch.Tensor,
    mask: torch.Tensor,
    denominator: torch.Tensor,
    stats: Optional[MetricsAccumulator] = None,
    widths: Optional[TrimWidths] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A separate critic's pass over the trimmed micro-batch `batch` and its share of the minibatch loss: (values
    (B, T) with their graph, vf_coef x clipped value loss aggregated by ppo.loss_aggregation). `stats`: where the
    value-loss statistics go (None: the caller's objective reports them)."""
    padded = None if widths is None else widths.padded
    with autocast():
        values = critic(batch.input_ids, batch.attention_mask, batch.prompt_ids.shape[1], padded)
    values = values[:, : batch.response_ids.shape[1]]
    vf_loss, vf_stats = clipped_value_loss(values, batch.values, returns, cfg.ppo.value_clip_range)
    if stats is not None:
        stats.add(STAT_NAMES["value"], masked_mean(vf_loss.detach(), mask))
        stats.add(STAT_NAMES["value_clipped"], masked_mean(vf_stats["clipped"], mask))
    return values, LOSS_AGGREGATIONS[cfg.ppo.loss_aggregation].share(value_coef(cfg) * vf_loss, mask, denominator)


def hold_policy(stats: MetricsAccumulator) -> None:
    """A batch without a reward signal (`ppo.signal_tolerance`): no policy weight moves, so the updated policy is
    the rollout policy itself (`policy/approxkl_avg`, `policy/clipfrac_avg` exactly 0; `update/skipped_no_signal`
    says why). A separate critic still learns its values (`critic_only_loss`); a shared value head takes no step
    at all, since its value loss would move the trunk, and the trunk is the policy."""
    stats.add(STAT_NAMES["approx_kl"], 0.0)
    stats.add(STAT_NAMES["policy_clipped"], 0.0)


def step_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """The learning-rate schedule follows iterations, whether the optimizer stepped in one or not (a batch without
    a reward signal): torch's warning about a schedule step before any optimizer step does not apply."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        scheduler.step()


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


def gradient_norm(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of the parameters' gradients (as `clip_grad_norm_` reports it), no gradient scaled."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads)


def gradient_clipper(
    clip_grad_norm: Callable[[list, float], torch.Tensor], params: list, max_grad_norm: float, always: bool
) -> Callable[[], torch.Tensor]:
    """`ppo.max_grad_norm`: `clip_grad_norm(params, max_grad_norm)` (accelerate's), or with 0 the gradient norm
    alone: no gradient multiplied by 1. `always`: clip anyway (DeepSpeed keeps the gradients itself)."""
    if max_grad_norm or always:
        return partial(clip_grad_norm, params, max_grad_norm or float("inf"))
    return partial(gradient_norm, params)


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` honours a `found_inf` flag on the device (torch's fused Adam/AdamW, as GradScaler
    uses it): with the flag set the kernel leaves weights, moments and the step count untouched."""
    return isinstance(optimizer, torch.optim.Adam) and bool(optimizer.defaults.get("fused"))


class NonfiniteGuard:
    """The optimizer steps of one iteration, each skipped when the loss or the gradient is not finite, without a
    host read per step where the optimizer takes a `found_inf` flag (`takes_found_inf`): the skip happens in the
    optimizer's kernel and the streak of skipped steps is counted on the device. `check()` reads it once per
    iteration and raises TrainingError once `ppo.max_nonfinite_updates` were skipped in a row (the run then stops
    at the end of that iteration's update: skipped steps changed nothing and no checkpoint is written).
    Other optimizers (the per-tensor AdamW, DeepSpeed's) read the flag on the host at every step.

    `streak`: steps skipped in a row before this iteration; `limit`: `ppo.max_nonfinite_updates`."""

    def __init__(self, optimizer: torch.optim.Optimizer, streak: int, limit: int, device: torch.device):
        self.optimizer, self.limit = optimizer, limit
        self.inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        self.on_device = takes_found_inf(self.inner)
        self.streak = torch.full((), float(streak), device=device)  # skipped in a row up to now
        self.longest = self.streak.clone()  # the longest streak seen this iteration
        self.last_loss = torch.zeros((), device=device)  # of the last skipped step, for the error message
        self.last_norm = torch.zeros((), device=device)

    def step(
        self, clip_grad_norm: Callable[[], float | torch.Tensor], loss: torch.Tensor, stats: MetricsAccumulator
    ) -> None:
        """One optimizer step after gradient clipping (`clip_grad_norm()` -> the norm before clipping), skipped
        when `loss` or the gradient norm is not finite; the gradients are zeroed either way."""
        grad_norm = torch.as_tensor(clip_grad_norm()).float()
        found = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))  # 0-dim bool
        stats.add("update/skipped_nonfinite", found)
        stats.add_where(GRAD_NORM, grad_norm, ~found)
        if self.on_device:
            setattr(self.inner, "found_inf", found.float())  # read by torch's fused Adam step
            try:
                self.optimizer.step()
            finally:
                delattr(self.inner, "found_inf")  # no flag left behind for a later caller
        elif not bool(found):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.streak = torch.where(found, self.streak + 1, torch.zeros_like(self.streak))
        self.longest = torch.maximum(self.longest, self.streak)
        self.last_loss = torch.where(found, loss.detach().float(), self.last_loss)
        self.last_norm = torch.where(found, grad_norm.detach(), self.last_norm)

    def check(self) -> int:
        """The streak after this iteration's steps (one host read); TrainingError when it reached the limit."""
        streak, longest, loss, norm = torch.stack([self.streak, self.longest, self.last_loss, self.last_norm]).tolist()
        if longest >= self.limit:
            raise TrainingError(
                f"{self.limit} updates in a row had a non-finite loss or gradient (ppo.max_nonfinite_updates: "
                f"{self.limit}; the last: loss {loss}, grad norm {norm}); stopping. Lower ppo.learning_rate, check "
                "the reward scale, or use reward.clip."
            )
        return int(streak)
