"""How one call samples: the settings a sampling engine takes with each call (`SamplingEngine.sample`), so that one
engine samples training's rollouts, evaluation's responses and the TRL drop-in's near-greedy completions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmppo.config import RolloutConfig


@dataclass(frozen=True)
class Sampling:
    """The temperature and the most new tokens of one call (in an episode: of each turn)."""

    temperature: float
    max_new_tokens: int

    @classmethod
    def of(cls, rollout: RolloutConfig) -> Sampling:
        """The run's settings: `rollout.temperature`, `rollout.max_new_tokens`."""
        return cls(rollout.temperature, rollout.max_new_tokens)
