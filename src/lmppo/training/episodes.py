"""Phase 1 with an environment (`environment.path`): the batch's episodes played turn by turn
(`lmppo.environments.episodes`), laid out as a `Rollout` whose responses are whole episodes.

The episode's tokens after its opening are the response (all real tokens); `action_mask` marks the policy's turns,
the only tokens with logprobs, values, KL and loss (`Rollout.policy_mask`); the environment's tokens are context.
`terminated`: the environment ended the episode; `truncated`: `max_turns` or `max_episode_tokens` did
(`reward.truncation` applies). The reward sources see each episode's last turn as the completion.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Optional, TypeVar

import torch
from torch import nn

from lmppo.config import Config
from lmppo.core.batch import Rollout
from lmppo.core.masking import action_mask
from lmppo.core.rewards import place_turn_rewards
from lmppo.data.prompts import PromptSet
from lmppo.environments.episodes import ENDED_BY_ENVIRONMENT, STOP_REASONS, Episode, EpisodePlayer
from lmppo.episodes.road import EpisodePrompts, Episodes, Road
from lmppo.sampling.engines import PromptBatch
from lmppo.sampling.hf import left_pad
from lmppo.sampling.turns import TurnSampler

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Responses = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class EpisodeSource:
    """The run's `EpisodePlayer` over its training prompts, and its episodes as padded batches."""

    def __init__(self, player: EpisodePlayer, prompt_set: PromptSet, pad_id: int):
        self.player, self.prompt_set, self.pad_id = player, prompt_set, pad_id

    def play(self, sampler: TurnSampler, index: list[int], seeds: list[int]) -> list[Episode]:
        """The episodes of training prompts `index`, one environment each, built from the row's columns."""
        ps = self.prompt_set
        columns = [{"prompt": ps.shown_text(i), **c} for i, c in zip(index, ps.columns_of(index))]
        return self.player.play(sampler, [ps.ids[i] for i in index], columns, index, seeds)

    def batches(self, episodes: list[Episode], seeds: list[int], device: torch.device) -> tuple[PromptBatch, Responses]:
        """The episodes as a left-padded prompt batch and right-padded responses (ids, mask, terminated,
        truncated), like a sampling engine's."""
        prompts = [e.prompt for e in episodes]
        ids, mask = left_pad(prompts, self.pad_id)
        width = max(1, max(len(e.tokens) for e in episodes))
        response_ids = torch.full((len(episodes), width), self.pad_id, dtype=torch.long)
        response_mask = torch.zeros(len(episodes), width, dtype=torch.bool)
        for b, e in enumerate(episodes):
            response_ids[b, : len(e.tokens)] = torch.as_tensor(e.tokens, dtype=torch.long)
            response_mask[b, : len(e.tokens)] = True
        terminated = torch.tensor([e.stop_reason == ENDED_BY_ENVIRONMENT for e in episodes])
        responses = (response_ids.to(device), response_mask.to(device), terminated.to(device), (~terminated).to(device))
        return PromptBatch(ids.to(device), mask.to(device), prompts, seeds), responses


def with_episodes(rollout: Rollout, episodes: list[Episode], tokenizer: PreTrainedTokenizerBase) -> Rollout:
    """`rollout` (built from `EpisodeSource.batches`) with the episodes' turns: the action mask, turn ends and
    rewards, tool counts, transcripts and stop reasons; logprobs, values and KL inputs 0 off the policy's tokens;
    the completion text is the last turn's, the prompt text the opening's."""
    device, width = rollout.response_ids.device, rollout.response_ids.shape[1]
    turns = max(len(e.turn_ends) for e in episodes)
    starts = torch.full((len(episodes), turns), -1, dtype=torch.long)
    ends = torch.full((len(episodes), turns), -1, dtype=torch.long)
    rewards = torch.zeros(len(episodes), turns)
    for b, e in enumerate(episodes):
        k = len(e.turn_ends)
        starts[b, :k], ends[b, :k] = torch.tensor(e.turn_starts), torch.tensor(e.turn_ends)
        rewards[b, :k] = torch.tensor(e.turn_rewards)
    mask = action_mask(starts, ends, width).to(device)
    zeros = torch.zeros_like(rollout.logprobs)
    opening = [str(tokenizer.decode(e.prompt, skip_special_tokens=False)) for e in episodes]
    return replace(
        rollout,
        logprobs=torch.where(mask, rollout.logprobs, zeros),
        ref_logprobs=torch.where(mask, rollout.ref_logprobs, zeros),
        values=torch.where(mask, rollout.values, zeros),
        entropy=None if rollout.entropy is None else torch.where(mask, rollout.entropy, zeros),
        action_mask=mask,
        turn_ends=ends.to(device),
        turn_rewards=rewards.to(device),
        tool_calls=torch.tensor([float(e.tool_calls) for e in episodes], device=device),
        tool_errors=torch.tensor([float(e.tool_errors) for e in episodes], device=device),
        transcripts=[list(e.transcript) for e in episodes],
        stop_reasons=[e.stop_reason for e in episodes],
        responses_text=[e.last_turn for e in episodes],
        prompts_text=opening,
        prompts_shown=[str(tokenizer.decode(e.prompt, skip_special_tokens=True)) for e in episodes],
    )


def last_turn_view(rollout: Rollout) -> tuple[Rollout, torch.Tensor]:
    """The rollout with each episode's last turn as its response (what reward sources score and place scores
    on), and (B,) where that turn starts in the episode's response."""
    assert rollout.action_mask is not None and rollout.turn_ends is not None
    last_end = rollout.turn_ends.max(dim=1).values  # (B,)
    B, T = rollout.response_ids.shape
    positions = torch.arange(T, device=last_end.device)[None, :].expand(B, T)
    # the last turn starts after the last non-policy token before its end (or at 0)
    before = (~rollout.action_mask) & (positions < last_end[:, None])
    start = torch.where(before, positions, torch.full_like(positions, -1)).max(dim=1).values + 1  # (B,)
    length = last_end - start + 1
    width = max(1, int(length.max()))
    take = (start[:, None] + torch.arange(width, device=start.device)[None, :]).clamp(max=T - 1)  # (B, W)
    inside = torch.arange(width, device=start.device)[None, :] < length[:, None]
    ids = torch.where(inside, rollout.response_ids.gather(1, take), rollout.response_ids.new_full((1,), 0))
    return replace(rollout, response_ids=ids, response_mask=inside, action_mask=None), start


R = TypeVar("R")


def episode_scores(rollout: Rollout, score_view: Callable[[Rollout], tuple[torch.Tensor, R]]) -> tuple[torch.Tensor, R]:
    """(B, T) placed scores of an episode batch: the reward sources' scores of the last turn (`score_view` on
    `last_turn_view`) moved to where that turn sits, plus each turn's environment reward on its last token."""
    view, start = last_turn_view(rollout)
    placed, result = score_view(view)  # (B, W)
    B, T = rollout.response_ids.shape
    columns = (start[:, None] + torch.arange(placed.shape[1], device=start.device)[None, :]).clamp(max=T - 1)
    moved = torch.zeros(B, T, dtype=placed.dtype, device=placed.device)
    moved.scatter_add_(1, columns.to(placed.device), torch.where(view.response_mask.to(placed.device), placed, 0.0))
    assert rollout.turn_ends is not None and rollout.turn_rewards is not None
    env = place_turn_rewards(rollout.turn_ends, rollout.turn_rewards.to(placed.dtype), T).to(placed.device)
    return moved + env, result


def episode_metrics(rollout: Rollout, gather: Callable[[torch.Tensor], float]) -> dict[str, float]:
    """`episode/*` (docs/metrics.md): turns, tool calls and tool errors per episode, the share of episodes ended by
    the environment and by each budget, the environment's reward per turn, the policy's share of the response
    tokens; {} for single responses. `gather`: (B,) -> the mean over every process's rows."""
    if rollout.turn_ends is None or rollout.turn_rewards is None or rollout.stop_reasons is None:
        return {}
    turns = (rollout.turn_ends >= 0).float().sum(1)  # (B,)
    out = {
        "episode/turns": gather(turns),
        "episode/reward_per_turn": gather(rollout.turn_rewards.sum(1)) / max(gather(turns), 1e-9),
        "episode/policy_token_frac": gather(rollout.policy_mask.sum(1).float())
        / max(gather(rollout.response_mask.sum(1).float()), 1e-9),
    }
    for reason in STOP_REASONS:
        ended = torch.tensor([float(r == reason) for r in rollout.stop_reasons], device=turns.device)
        out[f"episode/ended_by_{reason}"] = gather(ended)
    if rollout.tool_calls is not None and rollout.tool_errors is not None:
        out["episode/tool_calls"] = gather(rollout.tool_calls)
        out["episode/tool_errors"] = gather(rollout.tool_errors)
    return out


def episode_source(
    cfg: Config, tokenizer: PreTrainedTokenizerBase, stop_ids: torch.Tensor, prompt_set: PromptSet
) -> Optional[EpisodeSource]:
    """The run's `EpisodeSource` over its training prompts, None without `environment.path`."""
    if not cfg.environment.path:
        return None
    player = EpisodePlayer(cfg.environment, tokenizer, stop_ids.tolist())
    return EpisodeSource(player, prompt_set, tokenizer.pad_token_id)


def produce(
    road: Road,
    policy: nn.Module,
    prompts: EpisodePrompts,
    index: list[int],
    source: Optional[EpisodeSource],
) -> tuple[Episodes, Optional[list[Episode]]]:
    """The batch's episodes on the run's road: one response per row of prompts `index`, or with an environment one
    multi-turn episode per row, played with the road's engine in its precision (the prompts then become the
    episodes' openings), and the played episodes."""
    if source is None:
        return road.episodes(policy, prompts), None
    seeds = prompts.batch.seeds
    with road.precision():
        played = source.play(road.producer.engine.turn_sampler(policy), index, seeds)
    openings, (ids, mask, terminated, truncated) = source.batches(played, seeds, prompts.batch.ids.device)
    texts = [e.last_turn for e in played]
    opened = EpisodePrompts(openings, prompts.texts, prompts.columns)
    return Episodes(opened, ids, mask, terminated, truncated, texts), played
