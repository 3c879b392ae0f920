"""The rollout road: sample with the run's engine, in the run's precision, score with the run's reward sources,
reduce to per-response numbers. Training (`lmppo.training.rollout`), evaluation during training, the end-of-run
summary and `lmppo eval` (`lmppo.evaluation.heldout`) all take it.

Producing episodes is one step behind an interface (`EpisodeProducer`): `SingleTurn` samples one response per
prompt with a sampling engine; a multi-turn runner (environment steps between turns) is a second producer, and
scoring and reduction stay as they are."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

import torch
from torch import nn

from lmppo.core.rewards import place_turn_rewards
from lmppo.rewards import RewardResult, RewardSource, decode_completion, score_rollout
from lmppo.sampling.engines import PromptBatch, SamplingEngine

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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
    """The turns of multi-turn episodes (`lmppo.environments`): the response is every token after the opening,
    the policy's turns with the environment's observations between them."""

    action_mask: torch.Tensor  # (B, T) bool, True on the policy's tokens (the only ones trained on)
    turn_ends: torch.Tensor  # (B, K) long, each turn's last policy token; -1 for turns a row does not have
    turn_rewards: torch.Tensor  # (B, K) float, the environment's reward for each turn
    tool_calls: torch.Tensor  # (B,) float, tool calls made in the episode
    tool_errors: torch.Tensor  # (B,) float, of which failed
    transcripts: list[list[str]]  # B lists: turn, observation, turn, ... as text
    stop_reasons: list[str]  # B: environment, max_turns, max_episode_tokens or DROPPED

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
class Episodes:
    """What a policy did on a batch of prompts: one response per prompt (its tokens after the prompt's)."""

    prompts: EpisodePrompts
    response_ids: torch.Tensor  # (B, T) long, right-padded (padding after the stop token)
    response_mask: torch.Tensor  # (B, T) bool, True on the response's own tokens (stop token included)
    terminated: torch.Tensor  # (B,) bool, the response ended with the stop token
    truncated: torch.Tensor  # (B,) bool, the response hit max_new_tokens without it
    texts: list[str]  # B completions, decoded without padding or the stop token (an episode: its last turn)
    turns: Optional[Turns] = None  # multi-turn episodes; None: one response each

    @property
    def policy_mask(self) -> torch.Tensor:
        """(B, T) bool, the policy's own tokens: an episode's action mask, else the response mask."""
        return self.response_mask if self.turns is None else self.turns.action_mask

    @property
    def lengths(self) -> torch.Tensor:
        """(B,) the policy's tokens, stop tokens included."""
        return self.policy_mask.sum(1)

    @property
    def shown(self) -> list[str]:
        """B responses for tables: the completion, or an episode turn by turn (`[1] ...`, `> observation`, ...)."""
        if self.turns is None:
            return list(self.texts)
        return [transcript_text(t) for t in self.turns.transcripts]


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
    whether each response ended on its stop token; False: read from its text.

    Multi-turn episodes: the sources score each episode's last turn (its text is the completion), their scores are
    placed on that turn's tokens, and each turn's environment reward joins on the turn's last policy token;
    `per_source["environment"]` is an episode's total environment reward (weight 1)."""
    p = episodes.prompts
    turns = episodes.turns
    ids, mask = episodes.response_ids.cpu(), episodes.response_mask.cpu()
    if turns is not None:
        ids, mask, start = turns.last_turn(ids)
    result = score_rollout(
        sources,
        p.texts,
        episodes.texts,
        ids,
        mask,
        tokenizer,
        on_bad_output,
        terminated=episodes.terminated.cpu() if stop_known and turns is None else None,
        prompt_ids=p.batch.token_lists,
        columns=p.columns,
    )
    if turns is None:
        return result
    # an episode dropped on an environment failure (`environment.on_error: drop`) is invalid: no score, no gradient
    kept = torch.tensor([reason != DROPPED for reason in turns.stop_reasons], dtype=torch.bool)
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
    placed = torch.zeros(B, T).scatter_add_(1, columns, torch.where(mask, result.token_scores, 0.0))
    environment = place_turn_rewards(turns.turn_ends.cpu(), turns.turn_rewards.cpu().float(), T) * kept[:, None]
    return replace(
        result,
        token_scores=placed + environment,
        per_source={**result.per_source, "environment": environment.sum(1)},
    )


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
