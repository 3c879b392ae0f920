"""Phase 5 as an object: the `Updater` runs the PPO epochs of an iteration and keeps what lives between them (the
optimizer and its schedule, the minibatch-order generator, the streak of non-finite steps, the rollout's forward
kept for the first epoch, the compiled micro-batch). The trainer calls it; it never calls the trainer back. The
pieces it runs (minibatch order, widths, the objective, the guard) are `lmppo.training.update`."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import TYPE_CHECKING, Callable, Optional, Protocol

import torch

from lmppo.core.advantages import ADVANTAGE_ESTIMATORS
from lmppo.models.loading import PolicyOutput
from lmppo.training import compiled_update
from lmppo.training.metrics import MetricsAccumulator
from lmppo.training.update import (
    WIDTH_BUCKETS,
    NonfiniteGuard,
    RowWidths,
    TrimWidths,
    UpdateBatch,
    critic_only_loss,
    critic_value_loss,
    epoch_orders,
    gradient_clipper,
    hold_policy,
    loss_kl_estimator,
    minibatch_denominator,
    objective_and_stats,
    row_widths,
    step_schedule,
    trim,
    value_coef,
    went_too_far,
)

if TYPE_CHECKING:
    from lmppo.training.assembly import Components
    from lmppo.training.batch import Rollout


class MicroBatchLoss(Protocol):
    """A micro-batch's share of the minibatch loss (`Updater.micro_batch_loss`, `Updater.critic_loss`)."""

    def __call__(
        self,
        part: UpdateBatch,
        denominator: torch.Tensor,
        stats: MetricsAccumulator,
        forward: Optional[PolicyOutput] = None,
        widths: Optional[TrimWidths] = None,
    ) -> torch.Tensor: ...


class Updater:
    """The PPO update of a run, built from its components (`lmppo.training.assembly.Components`); `autocast`: the
    run's precision as a context factory. Its state between iterations: `generator` (minibatch order, seeded
    seed + 1), `nonfinite_in_a_row`, `first_epoch_forward` (`rollout_forward`), `last_lr`; a checkpoint holds the
    first two with the optimizer and schedule (`lmppo.training.resume`)."""

    def __init__(self, components: Components, autocast: Callable[[], AbstractContextManager]):
        c = components
        self.config, self.accelerator, self.strategy = c.config, c.accelerator, c.strategy
        self.device = c.accelerator.device
        self.actor, self.critic, self.kl_controller = c.actor, c.critic, c.kl_controller
        self.optimizer, self.scheduler, self.trainable_params = c.optimizer, c.scheduler, c.trainable_params
        self.autocast = autocast
        self.generator = torch.Generator().manual_seed(c.config.seed + 1)
        self.nonfinite_in_a_row = 0
        self.last_lr = 0.0  # the learning rate of the last iteration's updates
        self.first_epoch_forward: Optional[PolicyOutput] = None  # `lmppo.training.rollout.reuses_rollout_forward`
        self.compiled = compiled_update.build(c.config.ppo.compile, self.device, self.micro_batch_forward, c.config)
        # A separate critic runs only where it is read: its rollout pass when the advantages read values, its
        # training pass when its loss has a weight (`update.value_coef`: not with grpo, rloo, reinforce_pp).
        uses_values = ADVANTAGE_ESTIMATORS.trait(c.config.ppo.advantage_estimator, "uses_values")
        self.critic_reads = c.critic is not None and bool(uses_values)
        self.critic_learns = c.critic is not None and value_coef(c.config) > 0
        # It shares no weight with the policy: its value loss goes backward on its own, before the policy's pass, so
        # the two autograd graphs never coexist (the peak is the larger pass, not their sum; the gradients are the
        # same). DeepSpeed runs actor and critic as one engine: one backward per micro-batch there.
        self.critic_backward_first = self.critic_learns and c.strategy.zero is None

    def update(self, whole: UpdateBatch, stats: MetricsAccumulator, learn_policy: bool = True) -> None:
        """`ppo.num_epochs` passes over the batch in minibatches, one optimizer step each, no host read inside the
        minibatch loop; then the schedule's step. `learn_policy` False: a batch without a reward signal, whose
        epochs take the KL term alone (`kl.pull_without_signal`), a separate critic's loss alone, or none."""
        loss = self.micro_batch_loss if learn_policy else self.without_signal(stats)
        if not learn_policy:
            self.first_epoch_forward = None  # no reuse: the graph goes
        if loss is not None:  # None: a shared head without a signal takes no step at all
            self.nonfinite_in_a_row = self.epochs(whole, stats, loss, brake=learn_policy)  # TrainingError: too many
        self.last_lr = float(self.scheduler.get_last_lr()[0])  # the rate this iteration's updates used
        step_schedule(self.scheduler)

    def without_signal(self, stats: MetricsAccumulator) -> Optional[MicroBatchLoss]:
        """The micro-batch loss of a batch without a reward signal, or None for no epoch at all. With
        `kl.pull_without_signal`, a KL term in the loss and beta above 0: the KL term alone moves the policy. Else
        the policy holds (`hold_policy`): a separate critic's loss alone, and a shared head takes no step."""
        cfg = self.config
        if cfg.kl.pull_without_signal and loss_kl_estimator(cfg) is not None and self.kl_controller.coef > 0:
            stats.add("update/kl_pull", 1.0)
            return partial(self.micro_batch_loss, pull_only=True)
        hold_policy(stats)
        return self.critic_loss if self.critic_learns else None

    def epochs(self, whole: UpdateBatch, stats: MetricsAccumulator, loss: MicroBatchLoss, brake: bool) -> int:
        """`ppo.num_epochs` passes over `whole` with the micro-batch loss `loss`; returns the streak of non-finite
        steps skipped in a row (TrainingError at `ppo.max_nonfinite_updates`, `NonfiniteGuard`). `brake`:
        `ppo.target_kl` may end them early.

        No host read inside the minibatch loop: the epoch's row order is drawn on the host and every field gathered
        once per epoch (micro-batches are slices), each micro-batch's widths come from the rows' widths read once per
        iteration, non-finite steps are skipped on the device, metrics stay tensors; `ppo.target_kl`, when set,
        reads one number per minibatch."""
        ppo = self.config.ppo
        widths = row_widths(whole.rollout)  # one read per iteration
        guard = NonfiniteGuard(self.optimizer, self.nonfinite_in_a_row, ppo.max_nonfinite_updates, self.device)
        try:
            for epoch, order in epoch_orders(ppo.num_epochs, whole.rollout.batch_size, self.generator):
                shuffled = whole.shuffled(order)  # one index copy, every field gathered once
                if not self.epoch(shuffled, order, widths, epoch, guard, stats, loss, brake):
                    break  # ppo.target_kl: the rest of this iteration's epochs are skipped
        finally:
            streak = guard.check()
        return streak

    def epoch(
        self,
        shuffled: UpdateBatch,
        order: list[int],
        widths: RowWidths,
        epoch: int,
        guard: NonfiniteGuard,
        stats: MetricsAccumulator,
        loss_of: MicroBatchLoss,
        brake: bool,
    ) -> bool:
        """The minibatches of one epoch over `shuffled` (the batch in `order`), one optimizer step each; False when
        `ppo.target_kl` stopped the update. No host read: micro-batches are slices, their widths come from `widths`."""
        cfg, acc = self.config, self.accelerator
        W = acc.num_processes
        mb, micro = cfg.minibatch_size // W, cfg.ppo.micro_batch_size
        buckets = 0 if self.compiled is None else WIDTH_BUCKETS  # compiled: a few fixed shapes
        for start in range(0, shuffled.rollout.batch_size, mb):
            minibatch = shuffled.rows(start, start + mb)
            # DDP averages gradients over processes, so each divides by (global denominator / W): the result is the
            # `ppo.loss_aggregation` over the whole global minibatch (token_mean: its token mean)
            denominator = acc.reduce(minibatch_denominator(minibatch.train_mask, cfg), "sum").clamp(min=1) / W
            losses = []
            for m in range(0, mb, micro):
                part = minibatch.rows(m, m + micro)
                columns = widths.micro_batch(order[start + m : start + m + micro], buckets)  # taken on the host
                forward = self.kept_forward(part) if epoch == 0 else None
                last = m + micro >= mb  # the gradient all-reduce runs with the minibatch's last micro-batch
                with (
                    self.strategy.sync_gradients(last, self.actor, self.critic),
                    nullcontext() if self.compiled is None else self.compiled.timing(columns, micro),
                ):
                    loss = loss_of(part, denominator, stats, forward, columns)
                    acc.backward(loss, **self.strategy.backward_kwargs)
                losses.append(loss.detach())
            self.optimizer_step(acc.reduce(torch.stack(losses).sum(), "sum"), stats, guard)
            if brake and went_too_far(stats, len(losses), cfg.ppo.target_kl, self.strategy):
                return False
        return True

    def kept_forward(self, part: UpdateBatch) -> Optional[PolicyOutput]:
        """The rollout's pass (graph kept) for the micro-batch `part` of the first epoch, used once; None without."""
        if self.first_epoch_forward is None:
            return None
        forward, self.first_epoch_forward = self.first_epoch_forward, None
        assert forward.values is not None  # the rollout's pass keeps the values with the logits
        rows = part.index  # the rollout's rows of this micro-batch, on the device
        return PolicyOutput(logits=forward.logits[rows], values=forward.values[rows])

    def micro_batch_loss(
        self,
        part: UpdateBatch,
        denominator: torch.Tensor,
        stats: MetricsAccumulator,
        forward: Optional[PolicyOutput] = None,
        widths: Optional[TrimWidths] = None,
        pull_only: bool = False,
    ) -> torch.Tensor:
        """The micro-batch's share of the minibatch loss; `forward`: its policy/value pass if already run;
        `widths`: its columns, taken on the host (None: read from the batch, `update.trim`); `pull_only`: the KL term
        alone moves the policy (`update.objective_and_stats`)."""
        batch, keep = trim(part.rollout, widths)
        advantages, returns, mask = part.advantages[:, :keep], part.returns[:, :keep], part.train_mask[:, :keep]
        coef = self.kl_controller.coef
        if forward is None and self.compiled is not None and widths is not None and not pull_only:  # ppo.compile
            loss, objective_stats = self.compiled(batch, advantages, returns, mask, denominator, coef)
        else:
            if forward is None:
                values = (
                    self.critic_backward(batch, returns, mask, denominator, widths)
                    if self.critic_backward_first
                    else None
                )
                forward = self.micro_batch_forward(batch, None if widths is None else widths.padded, values)
            loss, objective_stats = objective_and_stats(
                batch, forward, advantages, returns, mask, denominator, self.config, coef, pull_only
            )
        for name, value in objective_stats.items():
            stats.add(name, value)
        return loss

    def critic_loss(
        self,
        part: UpdateBatch,
        denominator: torch.Tensor,
        stats: MetricsAccumulator,
        forward: Optional[PolicyOutput] = None,
        widths: Optional[TrimWidths] = None,
    ) -> torch.Tensor:
        """A separate critic's loss alone (`update.critic_only_loss`); `forward` unused (no policy pass)."""
        return critic_only_loss(self.critic, self.autocast, self.config, part, denominator, stats, widths)

    def micro_batch_forward(
        self, batch: Rollout, padded: Optional[bool] = None, values: Optional[torch.Tensor] = None
    ) -> PolicyOutput:
        """The policy's response logits and the values of a trimmed micro-batch (`padded`: `run_trunk`); `values`:
        the separate critic's, already taken (`critic_backward`), else its pass runs here; a critic that does not
        learn (`critic_learns`) runs no pass: its values are the rollout's (it has not moved)."""
        P, ids, att = batch.prompt_ids.shape[1], batch.input_ids, batch.attention_mask
        with self.autocast():
            out = self.actor(ids, att, P, self.config.rollout.temperature, padded)
            if values is None and self.critic is not None:
                values = self.critic(ids, att, P, padded) if self.critic_learns else batch.values
        return PolicyOutput(logits=out.logits, values=out.values if values is None else values)

    def critic_backward(
        self,
        batch: Rollout,
        returns: torch.Tensor,
        mask: torch.Tensor,
        denominator: torch.Tensor,
        widths: Optional[TrimWidths],
    ) -> torch.Tensor:
        """The separate critic's pass, its share of the loss and that share's backward, now: its graph is freed
        before the policy's pass (`critic_backward_first`). Returns its values, detached: the objective reads them
        for the value loss's statistics, which then carry no gradient."""
        assert self.critic is not None
        values, loss = critic_value_loss(
            self.critic, self.autocast, self.config, batch, returns, mask, denominator, widths=widths
        )
        self.accelerator.backward(loss, **self.strategy.backward_kwargs)
        return values.detach()

    def rollout_forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, keep_graph: bool
    ) -> PolicyOutput:
        """Response logits and values under the rollout's weights: without a graph (inference mode), or with it,
        kept in `first_epoch_forward` for the first epoch's backward (`rollout.reuses_rollout_forward`)."""
        temperature, unwrap = self.config.rollout.temperature, self.accelerator.unwrap_model
        if keep_graph:  # through the DDP wrappers: the backward of this pass must reduce gradients
            out = self.actor(input_ids, attention_mask, prompt_len, temperature)
            values = (
                out.values
                if self.critic is None
                else self.rollout_values(out.logits, input_ids, attention_mask, prompt_len)
            )
            self.first_epoch_forward = PolicyOutput(logits=out.logits, values=values)
            return PolicyOutput(logits=out.logits.detach(), values=values.detach())
        with torch.inference_mode():  # no-grad passes need no DDP wrapper
            out = unwrap(self.actor)(input_ids, attention_mask, prompt_len, temperature)
            if self.critic is not None:
                out.values = self.rollout_values(out.logits, input_ids, attention_mask, prompt_len, unwrap(self.critic))
            return out

    def rollout_values(
        self,
        logits: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_len: int,
        critic: Optional[torch.nn.Module] = None,
    ) -> torch.Tensor:
        """The separate critic's (B, T + 1) values of the rollout (`critic`: the module to run, default the wrapped
        one), or zeros without a pass when the advantages read no values (`critic_reads`). `logits`: (B, T, V)."""
        if not self.critic_reads:
            return torch.zeros(logits.shape[0], logits.shape[1] + 1, device=logits.device)
        critic = critic or self.critic
        assert critic is not None
        return critic(input_ids, attention_mask, prompt_len)

    def optimizer_step(self, loss: torch.Tensor, stats: MetricsAccumulator, guard: NonfiniteGuard) -> None:
        clip = gradient_clipper(
            self.accelerator.clip_grad_norm_,
            params=self.trainable_params,
            max_grad_norm=self.config.ppo.max_grad_norm,
            always=self.strategy.zero is not None,  # DeepSpeed keeps the gradients itself
        )
        guard.step(clip, loss, stats)
