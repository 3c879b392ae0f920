"""How training is spread over processes: one strategy object with the hooks the loop needs.

Design notes: docs/design.md, `lmppo.distributed.strategy`."""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import nn

from lmppo.config import Config, ModelConfig
from lmppo.core.masking import whiten_with
from lmppo.distributed.zero import ZeroSupport, accelerator_kwargs, prepare
from lmppo.models.loading import Critic, build_critic


class Strategy:
    """A single process, or DDP through accelerate."""

    zero: Optional[ZeroSupport] = None  # the DeepSpeed side (ZeroStrategy only)
    reuses_rollout_forward = True  # the rollout's policy/value pass may be the first epoch's forward
    backward_kwargs: dict = {}

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator

    # ---- models
    def build_critic(
        self, policy: nn.Module, policy_path: Optional[str], init_path: Optional[str], mc: ModelConfig
    ) -> Critic:
        return build_critic(policy, init_path, mc)

    def reference_model(self, policy: nn.Module, policy_path: Optional[str], mc: ModelConfig) -> Optional[nn.Module]:
        """None: `ReferencePolicy` copies the policy (or, with LoRA, needs no copy)."""
        return None

    def models_built(self) -> None:
        """The trainable models and the reference exist (reward models load after this)."""

    def prepare(self, actor: nn.Module, critic: Optional[nn.Module], optimizer):
        """(actor, critic, optimizer) wrapped for training."""
        return prepare(self.accelerator, actor, critic, optimizer, None)

    # ---- the loop
    def generation(self, actor: nn.Module) -> contextlib.AbstractContextManager:
        """The policy's weights ready for sampling inside the block."""
        return contextlib.nullcontext()

    def sync_gradients(self, last: bool, actor: nn.Module, critic: Optional[nn.Module]) -> contextlib.ExitStack:
        """Gradient all-reduce only on the last micro-batch of a minibatch (no-op with one process)."""
        stack = contextlib.ExitStack()
        if not last and self.accelerator.num_processes > 1:
            stack.enter_context(self.accelerator.no_sync(actor))
            if critic is not None:
                stack.enter_context(self.accelerator.no_sync(critic))
        return stack

    def mean_gradients(self, parameters: list[nn.Parameter]) -> None:
        """Each parameter's gradient averaged over the processes, in place (one collective; nothing with one
        process): DDP's all-reduce for a model trained outside `prepare` (`lmppo reward-model` scores through the
        model's parts, not its forward). A process without a gradient for a parameter adds zeros."""
        if self.accelerator.num_processes == 1 or not parameters:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        flat = self.accelerator.reduce(torch.cat([g.reshape(-1) for g in grads]), "mean")
        for p, piece in zip(parameters, flat.split([g.numel() for g in grads])):
            p.grad = piece.view_as(p).clone()

    # ---- numbers over all processes (accelerate's collectives: the same under every strategy)
    def process_mean(self, value: float) -> float:
        return self.accelerator.reduce(torch.tensor(float(value), device=self.accelerator.device), "mean").item()

    def process_sum(self, value: torch.Tensor) -> float:
        return self.accelerator.reduce(value.float().to(self.accelerator.device), "sum").item()

    def process_sum_each(self, values: torch.Tensor) -> torch.Tensor:
        """`values` (any shape) summed element by element over the processes."""
        return self.accelerator.reduce(values.float().to(self.accelerator.device), "sum")

    def process_max(self, value: torch.Tensor) -> float:
        return self.accelerator.gather(value.float().reshape(1).to(self.accelerator.device)).max().item()

    def gather_mean(self, per_sample: torch.Tensor) -> float:
        """Mean over every sample of every process (TRL 1.12 averages per-process means)."""
        values = self.accelerator.gather(per_sample.float().reshape(-1).contiguous())
        return values.mean().item()

    def gather_std(self, per_sample: torch.Tensor) -> torch.Tensor:
        """0-dim population std over every sample of every process (`ppo.grpo_scale` `batch`)."""
        values = self.accelerator.gather(per_sample.float().reshape(-1).contiguous())
        return values.std(unbiased=False).to(per_sample.device, per_sample.dtype)

    def whiten(
        self, values: torch.Tensor, mask: torch.Tensor, floor_values: torch.Tensor | None = None, floor: float = 0.0
    ) -> torch.Tensor:
        """masked_whiten with mean and (unbiased) variance over the valid tokens of every process; the scale is at
        least `floor` x the std of `floor_values` over the same tokens (`ppo.whiten_floor`)."""
        mean, var = self.masked_moments(values, mask)
        min_std = floor * float(self.masked_moments(floor_values, mask)[1].sqrt()) if floor_values is not None else 0.0
        return whiten_with(values, mask, mean, var, min_std=min_std)

    def masked_moments(self, values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and unbiased variance of `values` over the valid tokens of every process."""
        m = mask.to(values.dtype)
        sums = torch.stack([(values * m).sum(), m.sum()])
        sums = self.accelerator.reduce(sums, "sum")
        mean = sums[0] / sums[1].clamp(min=1)
        sq = self.accelerator.reduce(((values - mean) ** 2 * m).sum(), "sum")
        return mean, sq / (sums[1] - 1).clamp(min=1)

    # ---- saving
    def saving(self, actor: nn.Module) -> contextlib.AbstractContextManager:
        """The full weights available for writing the model inside the block."""
        return contextlib.nullcontext()

    def full_weights(self, actor: nn.Module) -> contextlib.AbstractContextManager:
        """Every process can sample and score on its own inside the block."""
        return contextlib.nullcontext()

    # ---- checkpoints
    sharded_checkpoint = False  # True: the engine writes the model and optimizer state, one shard per process

    def checkpoint_layout(self) -> dict:
        """What a checkpoint written under this strategy records, and a resume must match (besides the number of
        processes): {} for one process and DDP (the checkpoint holds whole tensors)."""
        return {}

    def write_shards(self, actor: nn.Module, folder: str) -> None:
        """Every process writes its shards of the model and optimizer state into `folder` (a collective)."""
        raise NotImplementedError

    def read_shards(self, actor: nn.Module, folder: str) -> None:
        """Every process reads its shards back from checkpoint `folder` (a collective)."""
        raise NotImplementedError


class ZeroStrategy(Strategy):
    """DeepSpeed ZeRO-2 / ZeRO-3 (`lmppo.distributed.zero.ZeroSupport` does the work)."""

    reuses_rollout_forward = False  # the engine owns the backward: no graph kept from the rollout pass

    def __init__(self, accelerator: Any, zero: ZeroSupport):
        super().__init__(accelerator)
        self.zero = zero
        self.backward_kwargs = zero.backward_kwargs

    @property
    def stage(self) -> int:
        return self.zero.stage

    def build_critic(self, policy, policy_path, init_path, mc):
        return self.zero.build_critic(policy, policy_path, init_path, mc)

    def reference_model(self, policy, policy_path, mc):
        return self.zero.reference_model(policy, policy_path, mc)

    def models_built(self) -> None:
        self.zero.models_built()  # reward models load whole, never partitioned

    def prepare(self, actor, critic, optimizer):
        return prepare(self.accelerator, actor, critic, optimizer, self.zero)  # actor and critic: one engine

    def generation(self, actor):
        return self.zero.gathered_for_generation(actor)

    def sync_gradients(self, last, actor, critic):
        stack = contextlib.ExitStack()
        stack.enter_context(self.zero.micro_batch(last))  # the engine steps after the last micro-batch only
        return stack

    def saving(self, actor):
        return self.zero.gathered(actor)  # ZeRO-3: every process gathers the full weights for the save

    def full_weights(self, actor):
        return self.zero.full_weights(actor)

    sharded_checkpoint = True  # DeepSpeed's own checkpoint files (lmppo.distributed.zero.ZeroSupport.save_engine)

    def checkpoint_layout(self) -> dict:
        return {"deepspeed_stage": self.stage}

    def write_shards(self, actor, folder):
        self.zero.save_engine(actor, folder)

    def read_shards(self, actor, folder):
        self.zero.load_engine(actor, folder)


def make_strategy(accelerator: Any, cfg: Config) -> Strategy:
    """The strategy for this run: DeepSpeed when accelerate started it or the config asks for it, else DDP (one
    process: plain)."""
    zero = ZeroSupport.maybe(accelerator, cfg)
    return ZeroStrategy(accelerator, zero) if zero is not None else Strategy(accelerator)


__all__ = ["Strategy", "ZeroStrategy", "accelerator_kwargs", "make_strategy"]
