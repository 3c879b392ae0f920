"""The rollout road: sample with the run's engine, in the run's precision, score with the run's reward sources,
reduce to per-response numbers. Training (`lmppo.training.rollout`), evaluation during training, the end-of-run
summary and `lmppo eval` (`lmppo.evaluation.heldout`) all take it.

Producing episodes is one step behind an interface (`EpisodeProducer`): `SingleTurn` samples one response per
prompt with a sampling engine; a multi-turn runner (environment steps between turns) is a second producer, and
scoring and reduction stay as they are. A single response is an episode of one turn: every episode has its turns
(`Turns`), so nothing downstream asks which producer made it. The sampling settings go with each call
(`lmppo.sampling.settings.Sampling`): the road holds the run's, a caller may pass others."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence, TypeVar

import torch
from torch import nn

from lmppo.core.rewards import place_turn_rewards
from lmppo.rewards import RewardResult, RewardSource, decode_completion, score_rollout
from lmppo.sampling.engines import PromptBatch, SamplingEngine
from lmppo.sampling.settings import Sampling

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lmppo.config import EnvironmentConfig

ENDED_BY_STOP_TOKEN, ENDED_BY_LENGTH = "stop_token", "max_new_tokens"
"""The stop reasons of a single response: it ended on its stop token, or it was cut at `max_new_tokens`."""

Precision = Callable[[], AbstractContextManager[object]]
"""The run's precision as a context factory: bf16 autocast (`autocast_for`) or nothing."""

DROPPED = "dropped"
"""The stop reason of an episode dropped on an environment failure (`environment.on_error: drop`): invalid, like a
response a reward source gave bad output for under `reward.on_bad_output: drop`."""

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
    rows: Optional[list[int]] = None  # B indices of the prompts in their data (for messages); None: 0..B-1


@dataclass
class Turns:
    """The turns of a batch of episodes: the response is every token after the opening, the policy's turns with
    the environment's observations between them (`lmppo.environments`); a single response is one turn
    (`one_turn`)."""

    action_mask: torch.Tensor  # (B, T) bool, True on the policy's tokens (the only ones trained on)
    turn_ends: torch.Tensor  # (B, K) long, each turn's last policy token; -1 for turns a row does not have
    turn_rewards: torch.Tensor  # (B, K) float, the environment's reward for each turn
    last_stopped: torch.Tensor  # (B,) bool, the last turn ended on its stop token (not in its text)

    @classmethod
    def one_turn(cls, response_mask: torch.Tensor, terminated: torch.Tensor) -> Turns:
        """Single responses as episodes of one turn: every response token the policy's, the turn ending on the last
        real token, no environment reward."""
        return cls(
            action_mask=response_mask,
            turn_ends=(response_mask.sum(1) - 1)[:, None],
            turn_rewards=torch.zeros(response_mask.shape[0], 1, device=response_mask.device),
            last_stopped=terminated,
        )

    def last_turn(self, response_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each episode's last turn: its ids (B, W) right-padded, their mask (B, W), and (B,) where it starts."""
        B, T = response_ids.shape
        last_end = self.turn_ends.max(dim=1).values  # (B,)
        positions = torch.arange(T, device=last_end.device)[None, :].expand(B, T)
        before = (~self.action_mask) & (positions < last_end[:, None])  # the turn starts after the last context token
        start = torch.where(before, positions, torch.full_like(positions, -1)).max(dim=1).values + 1  # (B,)
        length = last_end - start + 1
        width = max(1, int(length.max()))
        offsets = torch.arange(width, device=start.device)[None, :]
        take = (start[:, None] + offsets).clamp(max=T - 1)  # (B, W)
        inside = offsets < length[:, None]
        return torch.where(inside, response_ids.gather(1, take), torch.zeros_like(take)), inside, start


@dataclass
class EpisodeSide:
    """What a batch of episodes holds besides its tensors, B entries each: the texts that reward sources read and
    tables show, and what happened in each episode."""

    texts: list[str]  # completions, decoded without padding or the stop token (an episode: its last turn)
    shown: list[str]  # responses as tables show them: the completion, or an episode turn by turn (`transcript_text`)
    transcripts: list[list[str]]  # turn, observation, turn, ... as text (a single response: its one turn)
    stop_reasons: list[str]  # why each ended (`stop_token`, `max_new_tokens`; an environment's reasons)
    tool_calls: list[int]  # tool calls made in the episode
    tool_errors: list[int]  # of which failed

    @classmethod
    def of_responses(cls, texts: list[str], terminated: list[bool]) -> EpisodeSide:
        """Single responses': each its own transcript of one turn, stopped by its stop token or its length, no tool
        call."""
        reasons = [ENDED_BY_STOP_TOKEN if t else ENDED_BY_LENGTH for t in terminated]
        return cls(list(texts), list(texts), [[t] for t in texts], reasons, [0] * len(texts), [0] * len(texts))


@dataclass
class Episodes:
    """What a policy did on a batch of prompts: one response per prompt (its tokens after the prompt's)."""

    prompts: EpisodePrompts
    response_ids: torch.Tensor  # (B, T) long, right-padded (padding after the stop token)
    response_mask: torch.Tensor  # (B, T) bool, True on the response's own tokens (stop token included)
    terminated: torch.Tensor  # (B,) bool, the response ended with the stop token
    truncated: torch.Tensor  # (B,) bool, the response hit max_new_tokens without it
    turns: Turns  # the turns of each episode (a single response: one)
    side: EpisodeSide  # what is not a tensor: texts, transcripts, stop reasons, tool counts

    @property
    def policy_mask(self) -> torch.Tensor:
        """(B, T) bool, the policy's own tokens (its turns' action mask)."""
        return self.turns.action_mask

    @property
    def lengths(self) -> torch.Tensor:
        """(B,) the policy's tokens, stop tokens included."""
        return self.policy_mask.sum(1)

    def select(self, index: list[int], device_index: Optional[torch.Tensor] = None) -> Episodes:
        """The episodes of rows `index` (`device_index`: the same rows on the tensors' device, when at hand)."""
        host = torch.as_tensor(index, dtype=torch.long)

        def take(t: torch.Tensor) -> torch.Tensor:
            return t[
                device_index if device_index is not None and device_index.device == t.device else host.to(t.device)
            ]

        return _rows_of(self, take, lambda xs: [xs[i] for i in index])

    def rows(self, start: int, stop: int) -> Episodes:
        """Rows start .. stop - 1: tensors as views, lists sliced."""
        return _rows_of(self, lambda t: t[start:stop], lambda xs: xs[start:stop])


Picked = TypeVar("Picked")


def _rows_of(value: Picked, tensor: Callable[[torch.Tensor], torch.Tensor], items: Callable[[list], list]) -> Picked:
    """`value` (a dataclass of tensors, lists and dataclasses) with the same rows of each of its fields."""
    if isinstance(value, torch.Tensor):
        return tensor(value)  # type: ignore[return-value]
    if isinstance(value, list):
        return items(value)  # type: ignore[return-value]
    if is_dataclass(value) and not isinstance(value, type):
        return replace(value, **{f.name: _rows_of(getattr(value, f.name), tensor, items) for f in fields(value)})
    return value


def transcript_text(transcript: Sequence[str]) -> str:
    """An episode turn by turn: `[1] turn`, `> observation`, `[2] turn`, ..."""
    lines, turn = [], 0
    for k, text in enumerate(transcript):
        if k % 2 == 0:
            turn += 1
            lines.append(f"[{turn}] {text}")
        else:
            lines.append("> " + text.replace("\n", "\n> "))
    return "\n".join(lines)


class EpisodeProducer(Protocol):
    """Produces episodes from a policy and prompts (one turn: `SingleTurn`; an environment loop: another)."""

    @property
    def engine(self) -> SamplingEngine: ...

    def produce(self, policy: nn.Module, prompts: EpisodePrompts, sampling: Sampling) -> Episodes: ...


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

    def produce(self, policy: nn.Module, prompts: EpisodePrompts, sampling: Sampling) -> Episodes:
        with self.precision():
            response_ids, response_mask, terminated, truncated = self.engine.sample(policy, prompts.batch, sampling)
        texts = [
            completion_text(self.tokenizer, r[m], bool(t)) for r, m, t in zip(response_ids, response_mask, terminated)
        ]
        return single_responses(prompts, response_ids, response_mask, terminated, truncated, texts)


def single_responses(
    prompts: EpisodePrompts,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    texts: list[str],
) -> Episodes:
    """One response per prompt as episodes of one turn each (`Turns.one_turn`)."""
    turns = Turns.one_turn(response_mask, terminated)
    side = EpisodeSide.of_responses(texts, terminated.tolist())
    return Episodes(prompts, response_ids, response_mask, terminated, truncated, turns, side)


class EnvironmentReward(RewardSource):
    """The environment's reward as a reward source, `environment`, weighted by `environment.reward_weight`: each
    turn's reward on the turn's last policy token; its score of an episode (`reward/environment`) is their sum.
    It reads the episodes' turns, not texts: the road's scoring places it (`score_episodes`)."""

    kind = "environment"

    def __init__(self, weight: float = 1.0):  # (no RewardSourceConfig: the environment section configures it)
        self.name, self.weight, self.span_placement = "environment", float(weight), "last"

    def place(self, turns: Turns, width: int) -> torch.Tensor:
        """(B, width) each turn's reward on its last policy token (CPU)."""
        return place_turn_rewards(turns.turn_ends.cpu(), turns.turn_rewards.cpu().float(), width)


def environment_sources(environment: EnvironmentConfig) -> list[RewardSource]:
    """The environment's reward source when the run plays one (`environment.path`), else none."""
    return [EnvironmentReward(environment.reward_weight)] if environment.path else []


@dataclass
class ResponseNumbers:
    """Per-response numbers of a batch of scored episodes (N responses)."""

    total: torch.Tensor  # (N,) weighted sum of the sources' scores
    per_source: dict[str, torch.Tensor]  # source name -> (N,) its unweighted score
    lengths: torch.Tensor  # (N,) response tokens, stop token included
    terminated: torch.Tensor  # (N,) bool
    valid: torch.Tensor  # (N,) bool, False where a source gave bad output (reward.on_bad_output: drop)
    truncated: torch.Tensor  # (N,) bool, cut by a length budget (what reward.truncation acts on)

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
            truncated=cat([p.truncated for p in parts], torch.bool),
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
    sources: Sequence[RewardSource]  # the run's reward sources (with an environment, its `EnvironmentReward`)
    tokenizer: PreTrainedTokenizerBase
    precision: Precision  # the run's: passes over the episodes (an evaluation's KL) run in it too
    sampling: Sampling  # the run's sampling settings, used by a call that passes none

    @property
    def temperature(self) -> float:
        """The run's sampling temperature: passes over the episodes divide logits by it."""
        return self.sampling.temperature

    @property
    def engine_name(self) -> str:
        """The sampling engine's registry name (`rollout.backend`)."""
        return self.producer.engine.name

    @property
    def samples_any_model(self) -> bool:
        """Whether the engine samples whatever model it is handed (`SamplingEngine.samples_any_model`)."""
        return self.producer.engine.samples_any_model

    def episodes(self, policy: nn.Module, prompts: EpisodePrompts, sampling: Optional[Sampling] = None) -> Episodes:
        """One episode per prompt from `policy`, sampled with `sampling` (None: the run's settings)."""
        return self.producer.produce(policy, prompts, sampling or self.sampling)

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
    sampling: Sampling,
) -> Road:
    """The road of a run that samples one response per prompt with `engine`."""
    return Road(SingleTurn(engine, tokenizer, precision), sources, tokenizer, precision, sampling)


def score_episodes(
    episodes: Episodes,
    sources: Sequence[RewardSource],
    tokenizer: PreTrainedTokenizerBase,
    on_bad_output: str,
    stop_known: bool,
) -> RewardResult:
    """The sources' scores of `episodes` placed on their tokens (CPU tensors). `stop_known`: `turns.last_stopped`
    says whether each last turn ended on its stop token; False: read from its text.

    The sources score each episode's last turn (its text is the completion; a single response is all of it), their
    scores are placed on that turn's tokens; a source that reads the turns (`EnvironmentReward`) places its own,
    weighted like any other."""
    p, turns = episodes.prompts, episodes.turns
    by_turns = [s for s in sources if isinstance(s, EnvironmentReward)]
    ids, mask, start = turns.last_turn(episodes.response_ids.cpu())
    result = score_rollout(
        [s for s in sources if not isinstance(s, EnvironmentReward)],
        p.texts,
        episodes.side.texts,
        ids,
        mask,
        tokenizer,
        on_bad_output,
        terminated=turns.last_stopped.cpu() if stop_known else None,
        prompt_ids=p.batch.token_lists,
        columns=p.columns,
    )
    # an episode dropped on an environment failure (`environment.on_error: drop`) is invalid: no score, no gradient
    kept = torch.tensor([reason != DROPPED for reason in episodes.side.stop_reasons], dtype=torch.bool)
    result = replace(
        result,
        token_scores=torch.where(kept[:, None], result.token_scores, 0.0),
        valid=result.valid & kept,
        per_source={name: torch.where(kept, v, 0.0) for name, v in result.per_source.items()},
        final_scores=torch.where(kept, result.final_scores, 0.0),
        num_invalid=result.num_invalid + int((result.valid & ~kept).sum()),
    )
    B, T = episodes.response_ids.shape
    columns = (start[:, None] + torch.arange(mask.shape[1])[None, :]).clamp(max=T - 1)
    token_scores = torch.zeros(B, T).scatter_add_(1, columns, torch.where(mask, result.token_scores, 0.0))
    per_source = dict(result.per_source)
    for source in by_turns:
        placed = source.place(turns, T) * kept[:, None]
        token_scores = token_scores + source.weight * placed
        per_source[source.name] = placed.sum(1)
    return replace(result, token_scores=token_scores, per_source=per_source)


def reduce_to_responses(episodes: Episodes, rewards: RewardResult) -> ResponseNumbers:
    """Per response: the weighted total, each source's score, the length and whether it terminated (on the CPU)."""
    return ResponseNumbers(
        total=rewards.token_scores.sum(1).float().cpu(),
        per_source={name: values.float().cpu() for name, values in rewards.per_source.items()},
        lengths=episodes.lengths.cpu(),
        terminated=episodes.terminated.cpu(),
        valid=rewards.valid.cpu(),
        truncated=episodes.truncated.cpu(),
    )
