"""The `environment:` section: multi-turn episodes with an environment and tools (docs/environments.md)."""

from __future__ import annotations

from dataclasses import field
from typing import Literal

from pydantic import PositiveInt

from lmppo.config.sections import _Section, section


@section
class EnvironmentConfig(_Section):
    path: str = ""
    """Multi-turn episodes (docs/environments.md): the environment class, a built-in name (`tools`: runs the
    functions of `tools` called by the model; `guess_number`: a higher/lower guessing game), `textarena:ENV_ID` (a
    single-player TextArena game, e.g. `textarena:GuessTheNumber-v0`; needs `pip install "lmppo[environments]"`),
    `module:Class` or `path/to/file.py:Class`. Empty: one response per prompt, no environment. One instance per
    episode, built with the prompt row's columns (and `prompt`) as keyword arguments; `reset()` gives the opening
    observation (a string or chat messages; None: the row's prompt), `step(action_text)` gives `(observation, reward,
    done)`. A class with `reset` and no `step` runs with TRL 1.16's `environment_factory` semantics (built with no
    arguments, `reset(**row)`, its public methods as tools, `get_reward()` at the end). From Python, objects:
    `PPOTrainer(cfg, environment_factory=Class, tools=[fn])` (named `python:...` here)."""
    max_turns: PositiveInt = 4
    """The most policy turns of an episode; an episode the environment has not ended by then is truncated
    (`reward.truncation` applies). Each turn is at most `rollout.max_new_tokens` tokens."""
    max_episode_tokens: PositiveInt = 256
    """The most tokens after the prompt: the policy's turns and the observations between them. An episode whose
    next turn or observation would not fit ends there, truncated."""
    max_observation_tokens: PositiveInt = 128
    """The longest one observation may be in tokens (chat-template glue included); a longer one stops the run
    with an error naming the environment and the turn (an environment bug, not an episode ending)."""
    tools: list[str] = field(default_factory=list)
    """Tool functions (`module:function` or `file.py:function`, with type hints and a docstring) offered to the
    model through the chat template's tool format; for `path: tools`, a TRL-style class (offered after its methods),
    or any environment that reads them."""
    render: Literal["auto", "chat", "text"] = "auto"
    """How observations become tokens: `chat` (chat messages through the tokenizer's chat template, only the new
    messages are encoded and appended), `text` (the observation's text encoded as it is), `auto` (chat when the
    tokenizer has a chat template)."""
