"""The episode loop: a batch of environments and a `TurnSampler` play their episodes turn by turn.

    opening ids = the rendered `reset()` (with the environment's tools), or the row's prompt ids
    repeat: sample a turn for every episode still going -> `step(turn text)` -> reward of the turn;
            done -> the environment ended it; else the observation's ids are appended and the next turn sampled
    until every episode has ended: by the environment, by `max_turns` (the last turn is still stepped, for its
    reward) or by `max_episode_tokens` (a turn cut at the budget is not stepped; an observation that leaves no room
    for a policy token is not appended). Both budget endings are truncations.
    then: the environment's `get_reward()`, if it has one, is added to the last turn's reward.
With `environment.on_error: drop` an environment failure ends its episode `dropped` (an episode whose environment
failed to build or reset still samples its first turn from the row's prompt, so every episode has a turn); the
scoring makes it invalid.

An episode always ends on a policy token, so its last real token is where a whole-episode score belongs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

import torch
from torch import nn

from lmppo.config import EnvironmentConfig
from lmppo.core.masking import action_mask
from lmppo.environments.api import EnvironmentError, EpisodeEnvironments, Messages
from lmppo.environments.factories import RunEnvironment, load_run_environment, prompt_messages
from lmppo.environments.render import Observations, observation_encoder
from lmppo.environments.tools import checked_tool_schemas
from lmppo.episodes.road import DROPPED, EpisodePrompts, Episodes, EpisodeSide, Precision, Turns, transcript_text
from lmppo.sampling.engines import PromptBatch, SamplingEngine
from lmppo.sampling.hf import left_pad
from lmppo.sampling.settings import Sampling
from lmppo.sampling.turns import TurnSampler

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ENDED_BY_ENVIRONMENT = "environment"
STOP_REASONS = (ENDED_BY_ENVIRONMENT, "max_turns", "max_episode_tokens")


@dataclass
class Episode:
    """One episode's tokens and what happened in it."""

    prompt: list[int]  # the opening's token ids
    tokens: list[int] = field(default_factory=list)  # everything after the prompt: turns and observations
    turn_starts: list[int] = field(default_factory=list)  # position in `tokens` of each turn's first token
    turn_ends: list[int] = field(default_factory=list)  # ... and of its last token
    turn_rewards: list[float] = field(default_factory=list)
    transcript: list[str] = field(default_factory=list)  # turn text, observation text, turn text, ...
    stop_reason: str = ""
    last_stopped: bool = False  # the last turn ended on its stop token
    tool_calls: int = 0
    tool_errors: int = 0

    @property
    def done(self) -> bool:
        return bool(self.stop_reason)

    @property
    def last_turn(self) -> str:
        return self.transcript[-1] if self.transcript else ""


def play_episodes(
    envs: EpisodeEnvironments,
    sampler: TurnSampler,
    encoder: Observations,
    tokenizer: PreTrainedTokenizerBase,
    row_prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    cfg: EnvironmentConfig,
    stop_ids: Sequence[int],
) -> list[Episode]:
    """Every episode of the batch to its end (module docstring). `row_prompts`: each row's own prompt ids (the
    opening when `reset()` returns None); `seeds`: one per episode (`lmppo.sampling.turns.turn_seeds`)."""
    stops = set(int(s) for s in stop_ids)
    openings = envs.reset()
    episodes = [
        Episode(prompt=_opening(envs, encoder, opening, row_prompts[b], b)) for b, opening in enumerate(openings)
    ]
    turn = sampler.first([e.prompt for e in episodes], seeds)
    number = 1
    while True:
        stepped, texts, ended_on_stop = [], [], {}
        for b, episode in enumerate(episodes):
            if episode.done:
                continue
            tokens = turn[b]
            room = cfg.max_episode_tokens - len(episode.tokens)
            cut = len(tokens) > room
            tokens = tokens[:room]
            episode.turn_starts.append(len(episode.tokens))
            episode.tokens.extend(tokens)
            episode.turn_ends.append(len(episode.tokens) - 1)
            ended_on_stop[b] = episode.last_stopped = bool(tokens) and tokens[-1] in stops and not cut
            text = str(tokenizer.decode(tokens[:-1] if ended_on_stop[b] else tokens, skip_special_tokens=True))
            episode.transcript.append(text)
            if cut or envs.dropped(b):  # a dropped environment (failed to build or reset) is not stepped
                episode.turn_rewards.append(0.0)
                episode.stop_reason = DROPPED if envs.dropped(b) else "max_episode_tokens"
            else:
                stepped.append(b)
                texts.append(text)
        observations: list[Optional[list[int]]] = [None] * len(episodes)
        for b, result in zip(stepped, envs.step(stepped, texts, number)):
            episode = episodes[b]
            if result is None:  # its step failed (on_error: drop)
                episode.turn_rewards.append(0.0)
                episode.stop_reason = DROPPED
                continue
            episode.turn_rewards.append(result.reward)
            if result.done or result.observation is None:
                episode.stop_reason = ENDED_BY_ENVIRONMENT
                continue
            if number >= cfg.max_turns:
                episode.stop_reason = "max_turns"
                continue
            ids = encoder.observation(result.observation, ended_on_stop[b])
            if len(ids) > cfg.max_observation_tokens:
                envs.fail(
                    b,
                    number,
                    f"the observation is {len(ids)} tokens, over environment.max_observation_tokens "
                    f"({cfg.max_observation_tokens})",
                )
                episode.stop_reason = DROPPED
                continue
            if len(episode.tokens) + len(ids) >= cfg.max_episode_tokens:
                episode.stop_reason = "max_episode_tokens"
                continue
            episode.tokens.extend(ids)
            episode.transcript.append("\n".join(m["content"] for m in result.observation))
            observations[b] = ids
        if all(o is None for o in observations):
            break
        turn = sampler.next(observations, number)
        number += 1
    for b, (episode, reward) in enumerate(zip(episodes, envs.final_rewards([len(e.turn_ends) for e in episodes]))):
        episode.turn_rewards[-1] += reward  # get_reward(): the end of the episode is its last turn
        if envs.dropped(b):  # (its get_reward() failed, under on_error: drop)
            episode.stop_reason = DROPPED
    for b, episode in enumerate(episodes):
        env = envs.envs[b]
        episode.tool_calls, episode.tool_errors = (
            int(getattr(env, "tool_calls", 0)),
            int(getattr(env, "tool_errors", 0)),
        )
    check_drops(envs, cfg.max_drop_fraction)
    return episodes


def check_drops(envs: EpisodeEnvironments, max_fraction: float) -> None:
    """One warning line naming the first failure of a batch with dropped episodes; an EnvironmentError when more
    than `max_fraction` of the batch dropped (`environment.max_drop_fraction`)."""
    if not envs.failures:
        return
    dropped, first = len(envs.failures), envs.failures[min(envs.failures)]
    if dropped > max_fraction * len(envs):
        raise EnvironmentError(
            f"{dropped} of {len(envs)} episodes of the batch failed, more than environment.max_drop_fraction "
            f"({max_fraction:g}); the first: {first}"
        )
    warnings.warn(f"dropped {dropped} of {len(envs)} episodes (environment.on_error: drop); the first: {first}")


class EpisodePlayer:
    """The run's environment, ready to play batches: its classes and tools loaded once (`environment.path` and
    `environment.tools`, or `environment`: loaded already, e.g. from objects passed to `PPOTrainer`), the
    observation encoder built once (`environment.render`)."""

    def __init__(
        self,
        cfg: EnvironmentConfig,
        tokenizer: PreTrainedTokenizerBase,
        stop_ids: Sequence[int],
        environment: Optional[RunEnvironment] = None,
    ):
        self.cfg, self.tokenizer, self.stop_ids = cfg, tokenizer, [int(s) for s in stop_ids]
        run = environment or load_run_environment(cfg)
        if run is None:
            raise EnvironmentError("no environment to play: set environment.path")
        self.name, self.tools = run.name, run.tools
        self.factory = run.factories[""] if not run.routed else run.factories  # the class(es) as loaded
        self.builder = run.builder(cfg.max_turns, lambda prompt: prompt_messages(str(prompt), tokenizer))
        self.encoder = observation_encoder(tokenizer, self.stop_ids, cfg.render)

    def play(
        self,
        sampler: TurnSampler,
        prompts: Sequence[Sequence[int]],
        columns: Sequence[Mapping[str, object]],
        rows: Sequence[int],
        seeds: Sequence[int],
    ) -> list[Episode]:
        """One episode per prompt row: its environment built from `columns` (the row's columns and `prompt`),
        `prompts` its own prompt ids, `rows` its index in the prompt data (for messages)."""
        envs = EpisodeEnvironments(self.builder, self.name, columns, rows, None, self.cfg)
        return play_episodes(envs, sampler, self.encoder, self.tokenizer, prompts, seeds, self.cfg, self.stop_ids)


def _opening(
    envs: EpisodeEnvironments, encoder: Observations, opening: Optional[Messages], row_prompt: Sequence[int], b: int
) -> list[int]:
    """Episode `b`'s opening ids: the rendered `reset()` with the environment's tools, or the row's prompt (also
    for an environment dropped before its first turn, or whose tools cannot be described)."""
    if opening is None:
        return list(row_prompt)
    tools = envs.tools(b)
    try:
        schemas = checked_tool_schemas(tools) if tools else None
    except ValueError as err:  # a tool without a docstring or type hints: the environment's failure
        envs.fail(b, 0, str(err))
        return list(row_prompt)
    return encoder.opening(opening, schemas)


@dataclass
class MultiTurn:
    """The road's second producer (`lmppo.episodes.road.EpisodeProducer`): one episode per prompt, played with the
    run's environment on the engine's turn sampler in the run's precision. The prompts' columns (and `prompt`, the
    prompt's text) build each episode's environment; the episodes' openings become their prompts."""

    engine: SamplingEngine
    player: EpisodePlayer
    tokenizer: PreTrainedTokenizerBase
    precision: Precision
    pad_id: int

    def produce(self, policy: nn.Module, prompts: EpisodePrompts, sampling: Sampling) -> Episodes:
        b = prompts.batch
        rows = prompts.rows if prompts.rows is not None else list(range(len(b.token_lists)))
        given = prompts.columns or [{} for _ in prompts.texts]
        columns = [{"prompt": text, **c} for text, c in zip(prompts.texts, given)]
        with self.precision():
            sampler = self.engine.turn_sampler(policy, sampling)
            played = self.player.play(sampler, b.token_lists, columns, rows, b.seeds)
        return as_episodes(played, prompts, self.tokenizer, self.pad_id)


def as_episodes(
    played: list[Episode], prompts: EpisodePrompts, tokenizer: PreTrainedTokenizerBase, pad_id: int
) -> Episodes:
    """Played episodes as the road's `Episodes`: the openings left-padded as the prompts, every token after them
    right-padded as the response, the turns' structure in `turns`."""
    device = prompts.batch.ids.device
    openings = [e.prompt for e in played]
    ids, mask = left_pad(openings, pad_id)
    batch = PromptBatch(ids.to(device), mask.to(device), openings, list(prompts.batch.seeds))
    texts = [str(tokenizer.decode(o, skip_special_tokens=False)) for o in openings]
    opened = EpisodePrompts(batch, texts, prompts.columns, prompts.rows)
    B, T, K = len(played), max(1, max(len(e.tokens) for e in played)), max(len(e.turn_ends) for e in played)
    response_ids = torch.full((B, T), pad_id, dtype=torch.long)
    response_mask = torch.zeros(B, T, dtype=torch.bool)
    starts, ends = torch.full((B, K), -1, dtype=torch.long), torch.full((B, K), -1, dtype=torch.long)
    rewards = torch.zeros(B, K)
    for row, e in enumerate(played):
        response_ids[row, : len(e.tokens)] = torch.as_tensor(e.tokens, dtype=torch.long)
        response_mask[row, : len(e.tokens)] = True
        k = len(e.turn_ends)
        starts[row, :k], ends[row, :k] = torch.tensor(e.turn_starts), torch.tensor(e.turn_ends)
        rewards[row, :k] = torch.tensor(e.turn_rewards)
    terminated = torch.tensor([e.stop_reason == ENDED_BY_ENVIRONMENT for e in played])  # dropped: truncated
    turns = Turns(
        action_mask=action_mask(starts, ends, T).to(device),
        turn_ends=ends.to(device),
        turn_rewards=rewards.to(device),
        last_stopped=torch.tensor([e.last_stopped for e in played], device=device),
    )
    side = EpisodeSide(
        texts=[e.last_turn for e in played],
        shown=[transcript_text(e.transcript) for e in played],
        transcripts=[list(e.transcript) for e in played],
        stop_reasons=[e.stop_reason for e in played],
        tool_calls=[e.tool_calls for e in played],
        tool_errors=[e.tool_errors for e in played],
    )
    return Episodes(
        opened,
        response_ids.to(device),
        response_mask.to(device),
        terminated.to(device),
        (~terminated).to(device),
        turns,
        side,
    )
