"""The environment contract (gymnasium's shape, as the field uses it for language models) and its checked use.

    env = Env(**columns)                  one instance per episode: the prompt row's columns (and `prompt`) by name
    env.reset() -> observation            the opening: a string, chat messages, or None (the row's own prompt)
    env.step(action_text) -> (observation, reward, done)
                                          observation: a string, chat messages, or None when done
                                          reward: a float for this turn; done: whether the episode ended

`reset` and `step` may be `async def`. An environment may also have `tools` (a list of functions offered to the
model through the chat template, `lmppo.environments.tools`), and `get_reward()` (sync or async: called once when
the episode has ended, however it ended; its number is added to the last turn's reward, TRL's name for it). A class
in TRL 1.16's `environment_factory` shape runs through `lmppo.environments.factories`, which wraps it into this
contract. An environment one that runs tools itself declares
`tool_call_timeout` (lmppo sets it to `environment.step_timeout`, and times each tool call instead of its `step`).

Every call into an environment (building it, `reset`, `step`) runs in a daemon thread, the calls of one batch
`environment.concurrency` at once, each within `environment.step_timeout` (`lmppo.environments.calls`). Everything
an environment returns is checked here. A failure (an exception, `sys.exit()`, a bad value, the timeout) is one
`EnvironmentError` line naming the environment, the episode's prompt row and the turn, raised before anything of
the iteration is trained on (`environment.on_error: stop`), or the end of that episode alone (`drop`).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Mapping, Optional, Sequence, SupportsFloat, TypeGuard, TypeVar

from lmppo.config import EnvironmentConfig
from lmppo.environments.calls import CallTimeout, run_calls
from lmppo.environments.textarena_games import TEXTARENA, textarena_factory
from lmppo.errors import ConfigError, LmppoError, RewardError
from lmppo.registry import ENVIRONMENTS
from lmppo.rewards import import_callable
from lmppo.rewards.sources import raised_text

T = TypeVar("T")

Factory = Callable  # a class, or any callable that builds an environment (its arguments vary)
Tool = Callable  # a function with type hints and a docstring (its arguments vary)
Messages = list[dict[str, str]]
"""Chat messages, each with a string `role` and `content` (as transformers' chat templates take them)."""


class EnvironmentError(LmppoError, RuntimeError):
    """An environment raised, or returned something lmppo cannot use."""


PYTHON_OBJECT = "python:"
"""How the config names an environment or a tool passed to `PPOTrainer` as a Python object (`python:MyEnv`): the
config stays text (saved with the run, compared on resume), and a run started without the object says so."""


def load_environment(path: str) -> Factory:
    """The class (any callable that builds an environment) named by `environment.path`: a built-in name,
    `textarena:ENV_ID` (`lmppo.environments.textarena_games`), or `module:Class` / `file.py:Class`."""
    if path.startswith(PYTHON_OBJECT):
        raise _not_passed("environment.path", path, "environment_factory")
    if path in ENVIRONMENTS.names():
        return ENVIRONMENTS.get(path)
    if path.startswith(TEXTARENA):
        return textarena_factory(path[len(TEXTARENA) :])
    try:
        return import_callable(path, what="environment")
    except RewardError as err:
        raise EnvironmentError(str(err)) from None


def load_tools(specs: Sequence[str]) -> list[Tool]:
    """The functions of `environment.tools`."""
    tools = []
    for spec in specs:
        if spec.startswith(PYTHON_OBJECT):
            raise _not_passed("environment.tools", spec, "tools")
        try:
            tools.append(import_callable(spec, what="tool"))
        except RewardError as err:
            raise EnvironmentError(str(err)) from None
    return tools


def _not_passed(field: str, value: str, keyword: str) -> ConfigError:
    return ConfigError(
        field,
        value,
        f"names a Python object passed as PPOTrainer(..., {keyword}=...); pass it again "
        f"(PPOTrainer.resume(run_dir, {keyword}=...)), or name an importable one (`module:name` or `file.py:name`)",
    )


def constructor_arguments(factory: Factory, offered: Mapping[str, object]) -> dict[str, object]:
    """The offered keyword arguments the factory takes: all of them with a `**kwargs` parameter, else those it names."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: offer everything
        return dict(offered)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(offered)
    return {k: v for k, v in offered.items() if k in params}


@dataclass
class StepResult:
    """One checked `step`: the observation as chat messages (None when the episode ended), the turn's reward, and
    whether the environment ended the episode."""

    observation: Optional[Messages]
    reward: float
    done: bool


class EpisodeEnvironments:
    """The environments of one batch of episodes, one per row, each built from its row's columns.

    `name`: the environment as the config names it (for messages); `rows`: each episode's prompt row index (for
    messages); `extra`: keyword arguments offered to every constructor (`tools`); `settings`: `environment.*`
    (`step_timeout`, `concurrency`, `on_error`). Every call into an environment runs through
    `lmppo.environments.calls`: the calls of one phase (building, reset, one turn's steps) concurrently, each within
    the timeout. A failure (an exception, `SystemExit`, a bad value, the timeout) raises one EnvironmentError line
    (`on_error: stop`, after the phase's other calls ended) or drops the episode (`drop`): `failures` holds its
    line, and the episode is not called again. A `KeyboardInterrupt` raised in an environment stops the run as
    Ctrl-C does."""

    def __init__(
        self,
        factory: Factory,
        name: str,
        columns: Sequence[Mapping[str, object]],
        rows: Sequence[int],
        extra: Optional[Mapping[str, object]] = None,
        settings: Optional[EnvironmentConfig] = None,
    ):
        self.name, self.rows = name, list(rows)
        self.settings = settings or EnvironmentConfig()
        self.failures: dict[int, str] = {}  # episode -> its failure's line (on_error: drop)
        builds = [partial(factory, **constructor_arguments(factory, {**(extra or {}), **c})) for c in columns]
        # any objects: the contract's methods are looked up by name
        self.envs: list[object] = self._call("building it", list(range(len(builds))), [0] * len(builds), builds)
        for env in self.envs:
            if hasattr(env, "tool_call_timeout"):  # it runs tools itself: each tool call gets the limit
                env.tool_call_timeout = self.settings.step_timeout

    def __len__(self) -> int:
        return len(self.envs)

    def error(self, episode: int, turn: int, what: str) -> EnvironmentError:
        when = f"turn {turn}" if turn else "reset"
        return EnvironmentError(f"environment `{self.name}`, prompt row {self.rows[episode]}, {when}: {what}")

    def fail(self, episode: int, turn: int, what: str, cause: Optional[BaseException] = None) -> None:
        """An environment failure of `episode`: raised (`on_error: stop`) or recorded and the episode dropped."""
        err = self.error(episode, turn, what)
        if self.settings.on_error == "stop":
            raise err from cause
        self.failures.setdefault(episode, str(err))

    def dropped(self, episode: int) -> bool:
        return episode in self.failures

    def tools(self, episode: int) -> list[Tool]:
        """The functions the environment of `episode` offers the model (its `tools` attribute), if any."""
        tools = getattr(self.envs[episode], "tools", None) or []
        if not isinstance(tools, (list, tuple)) or not all(callable(t) for t in tools):
            raise self.error(episode, 0, f"`tools` must be a list of functions, got {type(tools).__name__}")
        return list(tools)

    def reset(self) -> list[Optional[Messages]]:
        """The opening observation of every episode as chat messages (None: the row's own prompt, and for a
        dropped episode)."""
        live = [i for i in range(len(self.envs)) if not self.dropped(i)]
        openings = self._call("reset()", live, [0] * len(live), [getattr(self.envs[i], "reset") for i in live])
        out: list[Optional[Messages]] = [None] * len(self.envs)
        for i, opening in zip(live, openings):
            if opening is not None and not self.dropped(i):
                out[i] = self._checked(lambda: self._messages(opening, i, 0, "reset()"), i, 0)
        return out

    def step(self, episodes: Sequence[int], actions: Sequence[str], turn: int) -> list[Optional[StepResult]]:
        """`step(action)` of the environments of `episodes` (turn `turn`, from 1), checked, run concurrently
        (`environment.concurrency`); None for an episode dropped at this step (`on_error: drop`)."""
        steps = [partial(getattr(self.envs[i], "step"), action) for i, action in zip(episodes, actions)]
        untimed = [hasattr(self.envs[i], "tool_call_timeout") for i in episodes]  # timing each tool call instead
        raw = self._call("step()", list(episodes), [turn] * len(steps), steps, untimed)
        return [
            None if self.dropped(i) else self._checked(lambda: self._result(r, i, turn), i, turn)
            for r, i in zip(raw, episodes)
        ]

    def _call(
        self,
        what: str,
        episodes: list[int],
        turns: Sequence[int],
        calls: Sequence[Callable[[], object]],
        untimed: Sequence[bool] = (),
    ) -> list[object]:
        """The calls' values (None where one failed and its episode dropped), every failure through `fail` in the
        episodes' order once all calls ended."""
        s = self.settings
        outcomes = run_calls(calls, s.concurrency, s.step_timeout, untimed)
        for i, turn, outcome in zip(episodes, turns, outcomes):
            if isinstance(outcome.error, KeyboardInterrupt):
                raise outcome.error
            if outcome.timed_out:
                self.fail(i, turn, f"{what} did not return within environment.step_timeout ({s.step_timeout:g} s)")
            elif isinstance(outcome.error, CallTimeout):
                self.fail(i, turn, str(outcome.error), outcome.error)
            elif outcome.error is not None:
                self.fail(i, turn, f"{what} raised {raised_text(outcome.error)}", outcome.error)
        return [o.value if o.error is None and not o.timed_out else None for o in outcomes]

    def _checked(self, check: Callable[[], T], episode: int, turn: int) -> Optional[T]:
        """`check()`'s value; its EnvironmentError (a bad value) is a failure of `episode` (None when dropped)."""
        try:
            return check()
        except EnvironmentError as err:
            if self.settings.on_error == "stop":
                raise
            self.failures.setdefault(episode, str(err))
            return None

    def final_rewards(self, turns: Sequence[int]) -> list[float]:
        """`get_reward()` of every environment that has one, once its episode has ended (`turns`: each episode's
        number of turns, for messages), checked, run as the steps are (concurrently, each within the timeout); 0.0
        for the others and for dropped episodes (an episode whose `get_reward()` fails is dropped under `drop`)."""
        asked = [
            i for i, env in enumerate(self.envs) if not self.dropped(i) and callable(getattr(env, "get_reward", None))
        ]
        raw = self._call(
            "get_reward()", asked, [turns[i] for i in asked], [getattr(self.envs[i], "get_reward") for i in asked]
        )
        out = [0.0] * len(self.envs)
        for i, r in zip(asked, raw):
            if not self.dropped(i):
                out[i] = self._checked(lambda: self._reward(r, i, turns[i], "get_reward()"), i, turns[i]) or 0.0
        return out

    def _reward(self, reward: object, episode: int, turn: int, what: str) -> float:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) and not _is_number(reward):
            raise self.error(episode, turn, f"{what} must return a number, got {_short(reward)}")
        reward = float(reward)
        if not math.isfinite(reward):
            raise self.error(episode, turn, f"{what} must return a finite number, got {reward}")
        return reward

    def _result(self, value: object, episode: int, turn: int) -> StepResult:
        if not isinstance(value, (tuple, list)) or len(value) != 3:
            raise self.error(episode, turn, f"step() must return (observation, reward, done), got {_short(value)}")
        observation, reward, done = value
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) and not _is_number(reward):
            raise self.error(episode, turn, f"step()'s reward must be a number, got {_short(reward)}")
        reward = float(reward)
        if not math.isfinite(reward):
            raise self.error(episode, turn, f"step()'s reward must be finite, got {reward}")
        if not isinstance(done, bool) and not _is_bool(done):
            raise self.error(episode, turn, f"step()'s done must be True or False, got {_short(done)}")
        if observation is None:
            if not done:
                raise self.error(episode, turn, "step() returned no observation (None) but done=False")
            return StepResult(None, reward, True)
        messages = self._messages(observation, episode, turn, "step()'s observation")
        return StepResult(None if done else messages, reward, bool(done))

    def _messages(self, value: object, episode: int, turn: int, what: str) -> Messages:
        """A string as one user message; chat messages checked ({"role": str, "content": str} each)."""
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        if isinstance(value, dict):
            value = [value]
        if (
            isinstance(value, list)
            and value
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value
            )
        ):
            return [dict(m) for m in value]
        raise self.error(
            episode,
            turn,
            f"{what} must be a string or a list of chat messages ({{'role': ..., 'content': ...}}), "
            f"got {_short(value)}",
        )


def _is_number(x: object) -> TypeGuard[SupportsFloat]:
    """A numpy / torch scalar holding a real number."""
    try:
        return hasattr(x, "item") and isinstance(x.item(), (int, float)) and not isinstance(x.item(), bool)
    except Exception:  # noqa: BLE001
        return False


def _is_bool(x: object) -> bool:
    try:
        return hasattr(x, "item") and isinstance(x.item(), bool)
    except Exception:  # noqa: BLE001
        return False


def _short(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80] + ' ...' if len(text) > 80 else text}"
