"""The rollout road: sample with the run's engine, in the run's precision, score with the run's reward sources,
reduce to per-response numbers. Training (`lmppo.training.rollout`), evaluation during training, the end-of-run
summary and `lmppo eval` (`lmppo.evaluation.heldout`) all take it.

Producing episodes is one step behind an interface (`EpisodeProducer`): `SingleTurn` samples one response per
prompt with a sampling engine; a multi-turn runner (environment steps between turns) is a second producer, and
scoring and reduction stay as they are."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

import torch
from torch import nn

from lmppo.rewards import RewardResult, RewardSource, decode_completion, score_rollout
from lmppo.sampling.engines import PromptBatch, SamplingEngine

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Precision = Callable[[], AbstractContextManager[object]]
"""The run's precision as a context factory: bf16 autocast (`autocast_for`) or nothing."""

Columns = list[dict[str, object]]
"""Per response, its prompt record's other fields (reward functions take them by name)."""


def autocast_for(precision: str, device: torch.device) -> Precision:
    """The context factory of `precision` (`fp32` / `bf16`, as chosen for the run) on `device`."""
    if precision == "bf16":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext


@dataclass
class EpisodePrompts:
    """The prompts of one batch of episodes: the engine's batch (ids, mask, token lists, seeds) and their texts."""

    batch: PromptBatch
    texts: list[str]  # B prompt texts, as the policy saw them
    columns: Optional[Columns] = None  # B dicts; None: the prompts have no other fields


@dataclass
class Episodes:
    """What a policy did on a batch of prompts: one response per prompt (its tokens after the prompt's)."""

    prompts: EpisodePrompts
    response_ids: torch.Tensor  # (B, T) long, right-padded (padding after the stop token)
    response_mask: torch.Tensor  # (B, T) bool, True on the response's own tokens (stop token included)
    terminated: torch.Tensor  # (B,) bool, the response ended with the stop token
    truncated: torch.Tensor  # (B,) bool, the response hit max_new_tokens without it
    texts: list[str]  # B completions, decoded without padding or the stop token

    @property
    def lengths(self) -> torch.Tensor:
        """(B,) response tokens, stop token included."""
        return self.response_mask.sum(1)


class EpisodeProducer(Protocol):
    """Produces episodes from a policy and prompts (one turn: `SingleTurn`; an environment loop: another)."""

    @property
    def engine(self) -> SamplingEngine: ...

    def produce(self, policy: nn.Module, prompts: EpisodePrompts) -> Episodes: ...


def completion_text(tokenizer: PreTrainedTokenizerBase, ids: torch.Tensor, terminated: bool) -> str:
    """The text of a response's token ids (padding removed), without its stop token when it ended on one."""
    tokens: list[int] = ids.tolist()
    return decode_completion(tokenizer, tokens[:-1] if terminated else tokens)


@dataclass
class SingleTurn:
    """One response per prompt from the run's sampling engine, sampled in the run's precision."""

    engine: SamplingEngine
    tokenizer: PreTrainedTokenizerBase
    precision: Precision

    def produce(self, policy: nn.Module, prompts: EpisodePrompts) -> Episodes:
        with self.precision():
            response_ids, response_mask, terminated, truncated = self.engine.sample(policy, prompts.batch)
        texts = [
            completion_text(self.tokenizer, r[m], bool(t)) for r, m, t in zip(response_ids, response_mask, terminated)
        ]
        return Episodes(prompts, response_ids, response_mask, terminated, truncated, texts)


@dataclass
class ResponseNumbers:
    """Per-response numbers of a batch of scored episodes (N responses)."""

    total: torch.Tensor  # (N,) weighted sum of the sources' scores
    per_source: dict[str, torch.Tensor]  # source name -> (N,) its unweighted score
    lengths: torch.Tensor  # (N,) response tokens, stop token included
    terminated: torch.Tensor  # (N,) bool
    valid: torch.Tensor  # (N,) bool, False where a source gave bad output (reward.on_bad_output: drop)

    @classmethod
    def concat(cls, parts: Sequence[ResponseNumbers]) -> ResponseNumbers:
        """The numbers of several batches, in order (no batch: N = 0)."""

        def cat(xs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
            return torch.cat(xs) if xs else torch.zeros(0, dtype=dtype)

        names = list(parts[0].per_source) if parts else []
        return cls(
            total=cat([p.total for p in parts], torch.float32),
            per_source={n: torch.cat([p.per_source[n] for p in parts]) for n in names},
            lengths=cat([p.lengths for p in parts], torch.long),
            terminated=cat([p.terminated for p in parts], torch.bool),
            valid=cat([p.valid for p in parts], torch.bool),
        )


@dataclass
class ScoredEpisodes:
    """Episodes with the sources' placed scores and their per-response numbers."""

    episodes: Episodes
    rewards: RewardResult
    numbers: ResponseNumbers


@dataclass
class Road:
    """Sample (the producer, with the run's engine and precision) -> score (the run's reward sources) -> reduce."""

    producer: EpisodeProducer
    sources: Sequence[RewardSource]
    tokenizer: PreTrainedTokenizerBase
    precision: Precision  # the run's: passes over the episodes (an evaluation's KL) run in it too
    temperature: float  # the run's sampling temperature: passes over the episodes divide logits by it

    @property
    def engine_name(self) -> str:
        """The sampling engine's registry name (`rollout.backend`)."""
        return self.producer.engine.name

    @property
    def samples_any_model(self) -> bool:
        """Whether the engine samples whatever model it is handed (`SamplingEngine.samples_any_model`)."""
        return self.producer.engine.samples_any_model

    def episodes(self, policy: nn.Module, prompts: EpisodePrompts) -> Episodes:
        return self.producer.produce(policy, prompts)

    def score(self, episodes: Episodes, on_bad_output: str = "error") -> RewardResult:
        """Every source's output on the episodes, checked and placed on their tokens (`rewards.score_rollout`)."""
        return score_episodes(episodes, self.sources, self.tokenizer, on_bad_output, stop_known=True)

    def run(self, policy: nn.Module, prompts: EpisodePrompts, on_bad_output: str = "error") -> ScoredEpisodes:
        """The whole road for one batch of prompts."""
        episodes = self.episodes(policy, prompts)
        rewards = self.score(episodes, on_bad_output)
        return ScoredEpisodes(episodes, rewards, reduce_to_responses(episodes, rewards))


def single_turn_road(
    engine: SamplingEngine,
    tokenizer: PreTrainedTokenizerBase,
    sources: Sequence[RewardSource],
    precision: Precision,
    temperature: float,
) -> Road:
    """The road of a run that samples one response per prompt with `engine`."""
    return Road(SingleTurn(engine, tokenizer, precision), sources, tokenizer, precision, temperature)


def score_episodes(
    episodes: Episodes,
    sources: Sequence[RewardSource],
    tokenizer: PreTrainedTokenizerBase,
    on_bad_output: str,
    stop_known: bool,
) -> RewardResult:
    """The sources' scores of `episodes` placed on their tokens (CPU tensors). `stop_known`: `terminated` says
    whether each response ended on its stop token; False: read from its text (one turn of an episode)."""
    p = episodes.prompts
    return score_rollout(
        sources,
        p.texts,
        episodes.texts,
        episodes.response_ids.cpu(),
        episodes.response_mask.cpu(),
        tokenizer,
        on_bad_output,
        terminated=episodes.terminated.cpu() if stop_known else None,
        prompt_ids=p.batch.token_lists,
        columns=p.columns,
    )


def reduce_to_responses(episodes: Episodes, rewards: RewardResult) -> ResponseNumbers:
    """Per response: the weighted total, each source's score, the length and whether it terminated (on the CPU)."""
    return ResponseNumbers(
        total=rewards.token_scores.sum(1).float().cpu(),
        per_source={name: values.float().cpu() for name, values in rewards.per_source.items()},
        lengths=episodes.lengths.cpu(),
        terminated=episodes.terminated.cpu(),
        valid=rewards.valid.cpu(),
    )
