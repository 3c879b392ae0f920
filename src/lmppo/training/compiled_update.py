"""`ppo.compile`: a micro-batch's policy/value forward and PPO objective through `torch.compile`.

Inductor fuses the trunk's norms, RoPE, SwiGLU and autocast casts and the objective's element-wise math;
AOTAutograd compiles the backward with it. On CUDA the mode is `reduce-overhead`: each shape is replayed as a CUDA
graph, so a micro-batch costs a few launches instead of thousands of host dispatches. Widths are rounded up to
`lmppo.training.update.WIDTH_BUCKETS` fixed widths per axis, so a run meets a few shapes; every new shape's first
micro-batch (compilation, then capture on its next calls) is timed and logged once as `time/compile`. Where
compilation fails: one warning, and the eager path for the rest of the run.
"""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch

from lmppo.config import Config
from lmppo.models.loading import PolicyOutput
from lmppo.training.batch import Rollout
from lmppo.training.update import TrimWidths, objective_and_stats

RECOMPILE_LIMIT = 64  # graphs per compiled function: WIDTH_BUCKETS^2 shapes x padded or not, with room to spare


def compiles(setting: str, device: torch.device) -> bool:
    """`ppo.compile`: `on`, `off`, or `auto` (compiled on CUDA, eager elsewhere: on a CPU inductor's compile takes
    longer than a short run saves)."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


class CompiledMicroBatch:
    """forward + objective of one trimmed micro-batch, compiled; called as `(batch, advantages, returns, mask,
    denominator, kl_coef) -> (loss, statistics)` like `objective_and_stats` after the forward."""

    def __init__(self, forward: Callable[[Rollout], PolicyOutput], cfg: Config, device: torch.device):
        def forward_objective(batch, advantages, returns, mask, denominator, kl_coef):
            return objective_and_stats(batch, forward(batch), advantages, returns, mask, denominator, cfg, kl_coef)

        self.device = device
        self.cuda_graphs = device.type == "cuda"
        self.eager = forward_objective
        # dynamic=None: the first shape compiles static, a second one recompiles with dynamic widths once; CUDA
        # graphs are still recorded per shape (a few: the widths are bucketed)
        self.compiled = torch.compile(forward_objective, mode="reduce-overhead" if self.cuda_graphs else None)
        dynamo = torch._dynamo.config
        limit = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"  # (torch < 2.7)
        setattr(dynamo, limit, max(getattr(dynamo, limit), RECOMPILE_LIMIT))
        self.failure = ""  # why compilation failed (then every call runs eagerly)
        self.compiled_calls = 0  # calls that ran the compiled function
        self.shapes: set[tuple[int, int, int, bool]] = set()
        self.unreported_seconds = 0.0  # first calls of new shapes since the last `take_seconds`

    def __call__(
        self,
        batch: Rollout,
        advantages: torch.Tensor,
        returns: torch.Tensor,
        mask: torch.Tensor,
        denominator: torch.Tensor,
        kl_coef: float,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        coef = torch.full((), kl_coef, device=self.device)  # a tensor: beta moving recompiles nothing
        if self.failure:
            return self.eager(batch, advantages, returns, mask, denominator, coef)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # a new micro-batch: the last one's outputs were consumed
        try:
            loss, stats = self.compiled(batch, advantages, returns, mask, denominator, coef)
        except Exception as error:  # noqa: BLE001  whatever the compiler raises, the eager path still trains
            self.failure = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
            warnings.warn(f"ppo.compile: compiling the update failed ({self.failure}); it runs eagerly", stacklevel=2)
            return self.eager(batch, advantages, returns, mask, denominator, coef)
        self.compiled_calls += 1
        if self.cuda_graphs:  # a CUDA graph's outputs are overwritten by its next replay: keep copies
            loss, stats = loss.clone(), {name: value.clone() for name, value in stats.items()}
        return loss, stats

    @contextmanager
    def timing(self, widths: TrimWidths, rows: int) -> Iterator[None]:
        """Around a micro-batch's loss and backward: a shape's first call is timed (its compilation)."""
        shape = (rows, widths.first_prompt_column, widths.response_width, widths.padded)
        if shape in self.shapes or self.failure:
            yield
            return
        self.shapes.add(shape)
        start = time.perf_counter()
        yield
        self.unreported_seconds += time.perf_counter() - start

    def take_seconds(self) -> float:
        seconds, self.unreported_seconds = self.unreported_seconds, 0.0
        return seconds


def build(
    setting: str, device: torch.device, forward: Callable[[Rollout], PolicyOutput], cfg: Config
) -> Optional[CompiledMicroBatch]:
    """The compiled micro-batch of a run (`ppo.compile`), or None for the eager update."""
    return CompiledMicroBatch(forward, cfg, device) if compiles(setting, device) else None


def split_compile_time(compiled: Optional[CompiledMicroBatch], phase_seconds: dict[str, float]) -> None:
    """The first calls of new shapes this iteration moved from the `update` phase to a `compile` phase of their
    own (`time/compile`, logged only when there were some; the phases still add up to the iteration)."""
    seconds = 0.0 if compiled is None else compiled.take_seconds()
    if seconds:
        phase_seconds["update"] -= seconds
        phase_seconds["compile"] = seconds
