"""The training state a checkpoint holds besides the trained tensors: one typed object between the trainer and the
checkpoint format (`lmppo.training.resume` builds and applies it, `lmppo.run.checkpoint` writes and reads it)."""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, field
from typing import Optional, cast

import torch


@dataclass
class RngState:
    """The random number generators of one process: they drive sampling and the minibatch order."""

    torch_cpu: torch.Tensor  # torch.get_rng_state()
    cuda: list[torch.Tensor]  # one per GPU ([] without CUDA)
    python: list  # random.getstate() as JSON-able lists
    numpy: Optional[list] = None  # np.random.get_state(legacy=True) as JSON-able lists

    @classmethod
    def capture(cls) -> "RngState":
        cuda = list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        version, internal, gauss = random.getstate()
        state = cls(torch.get_rng_state(), cuda, [version, list(internal), gauss])
        try:
            import numpy as np

            legacy = cast(
                "tuple[str, np.ndarray[tuple[int], np.dtype[np.uint32]], int, int, float]",
                np.random.get_state(legacy=True),
            )  # legacy=True: always the tuple form
            name, keys, pos, has_gauss, cached = legacy
            state.numpy = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
        except ImportError:  # pragma: no cover
            pass
        return state

    def restore(self) -> None:
        """Set every generator of this process; last thing before the next iteration (nothing may draw between)."""
        torch.set_rng_state(self.torch_cpu)
        if self.cuda and torch.cuda.is_available():
            if len(self.cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(self.cuda)
            else:
                warnings.warn(
                    f"the checkpoint holds RNG states of {len(self.cuda)} GPUs, this machine has "
                    f"{torch.cuda.device_count()}; sampling will not repeat the uninterrupted run exactly"
                )
        version, internal, gauss = self.python
        random.setstate((version, tuple(internal), gauss))
        if self.numpy is not None:
            import numpy as np

            name, keys, pos, has_gauss, cached = self.numpy
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


@dataclass
class TrainingState:
    """Everything besides the trained weights that decides the next iteration (docs/checkpoints.md, exact resume).

    The `state_dict()`s are those of the trainer's parts, kept as they are: JSON-able values, tensors only in
    `optimizer`, `reference`, `update_generator` and `rng`."""

    iteration: int  # completed iterations
    episode: int  # episodes trained on (all processes)
    train_seconds: float
    nonfinite_in_a_row: int  # updates skipped in a row for a non-finite loss or gradient
    stream: dict  # the prompt stream's position (`PromptStream.state_dict`)
    kl_controller: dict  # `KLController.state_dict`
    score_moments: dict  # this process's running score mean/std (`RunningMoments.state_dict`)
    scheduler: dict  # the LR scheduler's state_dict without `lr_lambdas`
    reference: dict  # the reference policy's state_dict ({} when it keeps no tensors)
    update_generator: torch.Tensor  # the minibatch-order generator's state
    rng: RngState
    frozen_fingerprint: str  # sha256 of the weights training does not change (`lmppo.run.checkpoint`)
    optimizer: Optional[dict] = None  # the optimizer's state_dict; None where DeepSpeed's shards hold it
    config: dict[str, object] = field(default_factory=dict)  # the run's config, secrets masked (as saved)
    inputs: dict[str, str] = field(default_factory=dict)  # fingerprints of the prompt data and model folders

    def counters(self) -> dict[str, object]:
        """The JSON part of state.json that is the trainer's own (the names are the checkpoint format's)."""
        return {
            "iteration": self.iteration,
            "episode": self.episode,
            "train_seconds": self.train_seconds,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "stream": self.stream,
            "kl_controller": self.kl_controller,
            "score_moments": self.score_moments,
            "scheduler": self.scheduler,
        }
