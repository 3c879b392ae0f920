"""The run's road (`lmppo.episodes.road`) from its config: the one factory that training, evaluation (during
training, the end-of-run summary, `lmppo eval`) and the TRL drop-in take."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from lmppo.environments.episodes import EpisodePlayer, MultiTurn
from lmppo.episodes.road import EpisodeProducer, Precision, Road, SingleTurn, environment_sources
from lmppo.sampling.settings import Sampling

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lmppo.config import Config
    from lmppo.environments.factories import RunEnvironment
    from lmppo.rewards import RewardSource
    from lmppo.sampling.engines import SamplingEngine


def run_road(
    cfg: Config,
    engine: SamplingEngine,
    tokenizer: PreTrainedTokenizerBase,
    stop_ids: Sequence[int],
    sources: Sequence[RewardSource],
    precision: Precision,
    environment: Optional[RunEnvironment] = None,
) -> Road:
    """The road of the run `cfg`: `engine` (`rollout.backend`'s) at the run's sampling settings, in `precision`;
    one response per prompt, or with `environment.path` one episode per prompt played with the run's environment
    (`environment`: as loaded already, e.g. from objects passed to `PPOTrainer`; None: loaded from the config),
    whose reward joins `sources` as the source `environment` (`environment.reward_weight`)."""
    producer: EpisodeProducer = SingleTurn(engine, tokenizer, precision)
    if cfg.environment.path:
        player = EpisodePlayer(cfg.environment, tokenizer, [int(s) for s in stop_ids], environment)
        producer = MultiTurn(engine, player, tokenizer, precision, tokenizer.pad_token_id)
    road_sources = [*sources, *environment_sources(cfg.environment)]
    return Road(producer, road_sources, tokenizer, precision, Sampling.of(cfg.rollout))
