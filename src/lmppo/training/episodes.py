"""Multi-turn episodes in training (`environment.path`): their metrics.

The episode's tokens after its opening are the response (all real tokens); `action_mask` marks the policy's turns,
the only tokens with logprobs, values, KL and loss (`Rollout.policy_mask`); the environment's tokens are context.
`terminated`: the environment ended the episode; `truncated`: `max_turns` or `max_episode_tokens` did
(`reward.truncation` applies). The reward sources see each episode's last turn as the completion (the road's
scoring, `lmppo.episodes.road.score_episodes`); the environment's reward is the source `environment`.
"""

from __future__ import annotations

from typing import Callable

import torch

from lmppo.environments.episodes import STOP_REASONS
from lmppo.episodes.road import DROPPED
from lmppo.training.batch import Rollout


def episode_metrics(rollout: Rollout, gather: Callable[[torch.Tensor], float]) -> dict[str, float]:
    """`episode/*` (docs/metrics.md): turns, tool calls and tool errors per episode, the share of episodes ended by
    the environment and by each budget, the share dropped on an environment failure, the environment's reward per
    turn, the policy's share of the response tokens. `gather`: (B,) -> the mean over every process's rows."""
    t, side = rollout.episodes.turns, rollout.episodes.side
    turns = (t.turn_ends >= 0).float().sum(1)  # (B,)
    out = {
        "episode/turns": gather(turns),
        "episode/reward_per_turn": gather(t.turn_rewards.sum(1)) / max(gather(turns), 1e-9),
        "episode/policy_token_frac": gather(rollout.policy_mask.sum(1).float())
        / max(gather(rollout.response_mask.sum(1).float()), 1e-9),
    }
    for reason in STOP_REASONS:
        ended = torch.tensor([float(r == reason) for r in side.stop_reasons], device=turns.device)
        out[f"episode/ended_by_{reason}"] = gather(ended)
    dropped = torch.tensor([float(r == DROPPED) for r in side.stop_reasons], device=turns.device)
    out["episode/dropped"] = gather(dropped)  # environment.on_error: drop
    out["episode/tool_calls"] = gather(torch.tensor([float(n) for n in side.tool_calls], device=turns.device))
    out["episode/tool_errors"] = gather(torch.tensor([float(n) for n in side.tool_errors], device=turns.device))
    return out
