"""Multi-turn episodes in training (`environment.path`): the road's `MultiTurn` producer for the run, episodes laid
out as a `Rollout`, and their metrics.

The episode's tokens after its opening are the response (all real tokens); `action_mask` marks the policy's turns,
the only tokens with logprobs, values, KL and loss (`Rollout.policy_mask`); the environment's tokens are context.
`terminated`: the environment ended the episode; `truncated`: `max_turns` or `max_episode_tokens` did
(`reward.truncation` applies). The reward sources see each episode's last turn as the completion (the road's
scoring, `lmppo.episodes.road.score_episodes`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Optional

import torch

from lmppo.config import Config
from lmppo.core.batch import Rollout
from lmppo.environments.episodes import STOP_REASONS, EpisodePlayer, MultiTurn
from lmppo.environments.factories import RunEnvironment
from lmppo.episodes.road import DROPPED, Precision, Turns
from lmppo.sampling.engines import SamplingEngine

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def episode_player(
    cfg: Config,
    tokenizer: PreTrainedTokenizerBase,
    stop_ids: torch.Tensor,
    environment: Optional[RunEnvironment] = None,
) -> Optional[EpisodePlayer]:
    """The run's environment ready to play (`environment`, loaded by the assembly, or `environment.path`), None
    without one."""
    if environment is None and not cfg.environment.path:
        return None
    return EpisodePlayer(cfg.environment, tokenizer, stop_ids.tolist(), environment)


def multi_turn(
    engine: SamplingEngine, player: EpisodePlayer, tokenizer: PreTrainedTokenizerBase, precision: Precision
) -> MultiTurn:
    """The road's producer of a run with an environment."""
    return MultiTurn(engine, player, tokenizer, precision, tokenizer.pad_token_id)


def with_turns(rollout: Rollout, turns: Turns) -> Rollout:
    """`rollout` with its episodes' turns (action mask, turn ends and rewards, tool counts, transcripts, stop
    reasons); logprobs, values and entropy 0 off the policy's tokens."""
    mask = turns.action_mask
    zeros = torch.zeros_like(rollout.logprobs)
    return replace(
        rollout,
        logprobs=torch.where(mask, rollout.logprobs, zeros),
        ref_logprobs=torch.where(mask, rollout.ref_logprobs, zeros),
        values=torch.where(mask, rollout.values, zeros),
        entropy=None if rollout.entropy is None else torch.where(mask, rollout.entropy, zeros),
        action_mask=mask,
        turn_ends=turns.turn_ends,
        turn_rewards=turns.turn_rewards,
        tool_calls=turns.tool_calls,
        tool_errors=turns.tool_errors,
        transcripts=turns.transcripts,
        stop_reasons=turns.stop_reasons,
    )


def rollout_turns(rollout: Rollout) -> Optional[Turns]:
    """The turns a rollout of episodes carries (None for single responses), as the road scores them."""
    r = rollout
    if r.action_mask is None or r.turn_ends is None or r.turn_rewards is None:
        return None
    assert r.tool_calls is not None and r.tool_errors is not None
    assert r.transcripts is not None and r.stop_reasons is not None
    return Turns(r.action_mask, r.turn_ends, r.turn_rewards, r.tool_calls, r.tool_errors, r.transcripts, r.stop_reasons)


def episode_metrics(rollout: Rollout, gather: Callable[[torch.Tensor], float]) -> dict[str, float]:
    """`episode/*` (docs/metrics.md): turns, tool calls and tool errors per episode, the share of episodes ended by
    the environment and by each budget, the share dropped on an environment failure, the environment's reward per
    turn, the policy's share of the response
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
    dropped = torch.tensor([float(r == DROPPED) for r in rollout.stop_reasons], device=turns.device)
    out["episode/dropped"] = gather(dropped)  # environment.on_error: drop
    if rollout.tool_calls is not None and rollout.tool_errors is not None:
        out["episode/tool_calls"] = gather(rollout.tool_calls)
        out["episode/tool_errors"] = gather(rollout.tool_errors)
    return out
