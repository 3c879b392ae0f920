"""The `environment:` section: multi-turn episodes with an environment and tools (docs/environments.md)."""

from __future__ import annotations

from dataclasses import field
from typing import Literal

from pydantic import NonNegativeFloat, PositiveInt

from lmppo.config.sections import _Section, section
from lmppo.config.types import Fraction


@section
class EnvironmentConfig(_Section):
    path: str = ""
    """Multi-turn episodes (docs/environments.md): the environment class: any `module:Class` or
    `path/to/file.py:Class` of yours, `textarena:ENV_ID` (a single-player TextArena game, e.g.
    `textarena:GuessTheNumber-v0`; needs `pip install "lmppo[environments]"`), or a built-in name (`tools`: runs
    the functions of `tools` called by the model; `guess_number`: a higher/lower guessing game). Empty: one response
    per prompt, no environment. One instance per episode, built with the prompt row's columns (and `prompt`) as
    keyword arguments; `reset()` gives the opening observation (a string or chat messages; None: the row's prompt),
    `step(action_text)` gives `(observation, reward, done)`. A class with `reset` and no `step` runs with TRL 1.16's
    `environment_factory` semantics (built with no arguments, `reset(**row)`, its public methods as tools,
    `get_reward()` at the end). From Python, objects: `PPOTrainer(cfg, environment_factory=Class, tools=[fn])`
    (named `python:...` here)."""
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
    step_timeout: NonNegativeFloat = 300.0
    """Seconds each call into the environment may take: building it, `reset()`, `step()` (awaited, for an `async
    def`), and each tool call of an environment that runs tools (the built-in `tools`); 0: no limit. A call past it
    is an environment failure (`on_error`) naming the environment, the prompt row, the turn and the limit. The
    default is far above a healthy step (a game's step takes microseconds, a sandbox's seconds) and stops a run whose
    remote sandbox never answers within minutes rather than never. A call past the limit cannot be killed: its
    thread is left running, as a daemon, and never holds up the process's exit."""
    on_error: Literal["stop", "drop"] = "stop"
    """What an environment failure does (an exception, `sys.exit()`, a bad return value, `step_timeout`): `stop`
    ends the run with one error line (the last checkpoint is kept, resume from it); `drop` ends only that episode:
    its tokens stay in the batch, untrained (no reward, no policy or value gradient, out of the reward means, like
    `reward.on_bad_output: drop`), counted in `episode/dropped`, and one warning line per batch names the first
    failure."""
    max_drop_fraction: Fraction = 0.5
    """With `on_error: drop`: the run stops with one error line when more than this fraction of a batch's episodes
    (over all processes) dropped (a broken environment, not a flaky one)."""
    concurrency: PositiveInt = 8
    """How many calls into the environments of one batch run at once (building, `reset()`, the `step()`s of one
    turn): synchronous ones in threads, `async def` ones on one event loop. Environments that draw from a shared
    random generator (the `random` module) in their steps see another order of draws at each run with more than
    1: seed one of their own from the row, or use 1."""
