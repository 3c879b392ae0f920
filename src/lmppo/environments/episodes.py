"""The episode loop: a batch of environments and a `TurnSampler` play their episodes turn by turn.

    opening ids = the rendered `reset()` (with the environment's tools), or the row's prompt ids
    repeat: sample a turn for every episode still going -> `step(turn text)` -> reward of the turn;
            done -> the environment ended it; else the observation's ids are appended and the next turn sampled
    until every episode has ended: by the environment, by `max_turns` (the last turn is still stepped, for its
    reward) or by `max_episode_tokens` (a turn cut at the budget is not stepped; an observation that leaves no room
    for a policy token is not appended). Both budget endings are truncations.

An episode always ends on a policy token, so its last real token is where a whole-episode score belongs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from lmppo.config import EnvironmentConfig
from lmppo.environments.api import EpisodeEnvironments, load_environment, load_tools
from lmppo.environments.render import Observations, observation_encoder
from lmppo.environments.tools import tool_schemas
from lmppo.sampling.turns import TurnSampler

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
    tokenizer: Any,
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
        Episode(prompt=list(row_prompts[b]) if opening is None else encoder.opening(opening, _schemas(envs, b)))
        for b, opening in enumerate(openings)
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
            ended_on_stop[b] = bool(tokens) and tokens[-1] in stops and not cut
            text = tokenizer.decode(tokens[:-1] if ended_on_stop[b] else tokens, skip_special_tokens=True)
            episode.transcript.append(text)
            if cut:
                episode.turn_rewards.append(0.0)
                episode.stop_reason = "max_episode_tokens"
            else:
                stepped.append(b)
                texts.append(text)
        observations: list[Optional[list[int]]] = [None] * len(episodes)
        for b, result in zip(stepped, envs.step(stepped, texts, number)):
            episode = episodes[b]
            episode.turn_rewards.append(result.reward)
            if result.done or result.observation is None:
                episode.stop_reason = ENDED_BY_ENVIRONMENT
                continue
            if number >= cfg.max_turns:
                episode.stop_reason = "max_turns"
                continue
            ids = encoder.observation(result.observation, ended_on_stop[b])
            if len(ids) > cfg.max_observation_tokens:
                raise envs.error(
                    b,
                    number,
                    f"the observation is {len(ids)} tokens, over environment.max_observation_tokens "
                    f"({cfg.max_observation_tokens})",
                )
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
    for b, episode in enumerate(episodes):
        env = envs.envs[b]
        episode.tool_calls, episode.tool_errors = (
            int(getattr(env, "tool_calls", 0)),
            int(getattr(env, "tool_errors", 0)),
        )
    return episodes


class EpisodePlayer:
    """The run's environment, ready to play batches: its class and tools imported once, the observation encoder
    built once (`environment.render`)."""

    def __init__(self, cfg: EnvironmentConfig, tokenizer: Any, stop_ids: Sequence[int]):
        self.cfg, self.tokenizer, self.stop_ids = cfg, tokenizer, [int(s) for s in stop_ids]
        self.factory = load_environment(cfg.path)
        self.tools = load_tools(cfg.tools)
        self.encoder = observation_encoder(tokenizer, self.stop_ids, cfg.render)

    def play(
        self,
        sampler: TurnSampler,
        prompts: Sequence[Sequence[int]],
        columns: Sequence[dict[str, Any]],
        rows: Sequence[int],
        seeds: Sequence[int],
    ) -> list[Episode]:
        """One episode per prompt row: its environment built from `columns` (the row's columns and `prompt`),
        `prompts` its own prompt ids, `rows` its index in the prompt data (for messages)."""
        extra = {"tools": self.tools} if self.tools else None
        envs = EpisodeEnvironments(self.factory, self.cfg.path, columns, rows, extra)
        return play_episodes(envs, sampler, self.encoder, self.tokenizer, prompts, seeds, self.cfg, self.stop_ids)


def transcript_text(transcript: Optional[list[str]]) -> str:
    """An episode turn by turn, for sample tables: `[1] turn`, `> observation`, `[2] turn`, ..."""
    lines, turn = [], 0
    for k, text in enumerate(transcript or []):
        if k % 2 == 0:
            turn += 1
            lines.append(f"[{turn}] {text}")
        else:
            lines.append("> " + text.replace("\n", "\n> "))
    return "\n".join(lines)


def _schemas(envs: EpisodeEnvironments, episode: int) -> Optional[list[dict[str, Any]]]:
    tools = envs.tools(episode)
    return tool_schemas(tools) if tools else None
