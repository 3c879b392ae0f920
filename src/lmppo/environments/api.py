"""The environment contract (gymnasium's shape, as the field uses it for language models) and its checked use.

    env = Env(**columns)                  one instance per episode: the prompt row's columns (and `prompt`) by name
    env.reset() -> observation            the opening: a string, chat messages, or None (the row's own prompt)
    env.step(action_text) -> (observation, reward, done)
                                          observation: a string, chat messages, or None when done
                                          reward: a float for this turn; done: whether the episode ended

`step` may be `async def` (the steps of one turn then run concurrently). An environment may also have `tools` (a list
of functions offered to the model through the chat template, `lmppo.environments.tools`), and `get_reward()` (sync
or async: called once when the episode has ended, however it ended; its number is added to the last turn's reward,
TRL's name for it). A class in TRL 1.16's `environment_factory` shape runs through `lmppo.environments.factories`,
which wraps it into this contract. Everything an environment
returns is checked here; a bad value or an exception becomes one `EnvironmentError` line naming the environment, the
episode's prompt row and the turn, raised before anything of the iteration is trained on.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from lmppo.environments.textarena_games import TEXTARENA, textarena_factory
from lmppo.errors import ConfigError, LmppoError, RewardError
from lmppo.registry import ENVIRONMENTS
from lmppo.rewards import import_callable

Messages = list[dict[str, Any]]


class EnvironmentError(LmppoError, RuntimeError):
    """An environment raised, or returned something lmppo cannot use."""


PYTHON_OBJECT = "python:"
"""How the config names an environment or a tool passed to `PPOTrainer` as a Python object (`python:MyEnv`): the
config stays text (saved with the run, compared on resume), and a run started without the object says so."""


def load_environment(path: str) -> Callable[..., Any]:
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


def load_tools(specs: Sequence[str]) -> list[Callable[..., Any]]:
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


def constructor_arguments(factory: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
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
    messages); `extra`: keyword arguments offered to every constructor (`tools`)."""

    def __init__(
        self,
        factory: Callable[..., Any],
        name: str,
        columns: Sequence[dict[str, Any]],
        rows: Sequence[int],
        extra: Optional[dict[str, Any]] = None,
    ):
        self.name, self.rows = name, list(rows)
        self.envs: list[Any] = []
        for i, row_columns in enumerate(columns):
            offered = {**(extra or {}), **row_columns}
            try:
                self.envs.append(factory(**constructor_arguments(factory, offered)))
            except Exception as err:  # noqa: BLE001 - a user's constructor; reported as one line
                raise self.error(i, 0, f"building it raised {type(err).__name__}: {err}") from err

    def __len__(self) -> int:
        return len(self.envs)

    def error(self, episode: int, turn: int, what: str) -> EnvironmentError:
        when = f"turn {turn}" if turn else "reset"
        return EnvironmentError(f"environment `{self.name}`, prompt row {self.rows[episode]}, {when}: {what}")

    def tools(self, episode: int) -> list[Callable[..., Any]]:
        """The functions the environment of `episode` offers the model (its `tools` attribute), if any."""
        tools = getattr(self.envs[episode], "tools", None) or []
        if not isinstance(tools, (list, tuple)) or not all(callable(t) for t in tools):
            raise self.error(episode, 0, f"`tools` must be a list of functions, got {type(tools).__name__}")
        return list(tools)

    def reset(self) -> list[Optional[Messages]]:
        """The opening observation of every episode as chat messages (None: the row's own prompt)."""
        out: list[Optional[Messages]] = []
        for i, env in enumerate(self.envs):
            try:
                opening = env.reset()
            except Exception as err:  # noqa: BLE001
                raise self.error(i, 0, f"reset() raised {type(err).__name__}: {err}") from err
            out.append(None if opening is None else self._messages(opening, i, 0, "reset()"))
        return out

    def step(self, episodes: Sequence[int], actions: Sequence[str], turn: int) -> list[StepResult]:
        """`step(action)` of the environments of `episodes` (turn `turn`, from 1), checked; async steps of one turn
        run concurrently."""
        raw: list[Any] = []
        for i, action in zip(episodes, actions):
            try:
                raw.append(self.envs[i].step(action))
            except Exception as err:  # noqa: BLE001
                raise self.error(i, turn, f"step() raised {type(err).__name__}: {err}") from err
        pending = [k for k, r in enumerate(raw) if inspect.isawaitable(r)]
        if pending:
            done = asyncio.run(_gather([raw[k] for k in pending]))
            for k, value in zip(pending, done):
                if isinstance(value, BaseException):
                    err = value
                    raise self.error(episodes[k], turn, f"step() raised {type(err).__name__}: {err}") from err
                raw[k] = value
        return [self._result(r, i, turn) for r, i in zip(raw, episodes)]

    def final_rewards(self, turns: Sequence[int]) -> list[float]:
        """`get_reward()` of every environment that has one, once its episode has ended (`turns`: each episode's
        number of turns, for messages), checked; 0.0 for the others. Async ones run concurrently."""
        raw: list[Any] = []
        for i, env in enumerate(self.envs):
            get = getattr(env, "get_reward", None)
            try:
                raw.append(get() if callable(get) else 0.0)
            except Exception as err:  # noqa: BLE001
                raise self.error(i, turns[i], f"get_reward() raised {type(err).__name__}: {err}") from err
        pending = [k for k, r in enumerate(raw) if inspect.isawaitable(r)]
        if pending:
            for k, value in zip(pending, asyncio.run(_gather([raw[k] for k in pending]))):
                if isinstance(value, BaseException):
                    raise self.error(k, turns[k], f"get_reward() raised {type(value).__name__}: {value}") from value
                raw[k] = value
        return [self._reward(r, i, turns[i], "get_reward()") for i, r in enumerate(raw)]

    def _reward(self, reward: Any, episode: int, turn: int, what: str) -> float:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) and not _is_number(reward):
            raise self.error(episode, turn, f"{what} must return a number, got {_short(reward)}")
        reward = float(reward)
        if not math.isfinite(reward):
            raise self.error(episode, turn, f"{what} must return a finite number, got {reward}")
        return reward

    def _result(self, value: Any, episode: int, turn: int) -> StepResult:
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

    def _messages(self, value: Any, episode: int, turn: int, what: str) -> Messages:
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


async def _gather(awaitables: list[Any]) -> list[Any]:
    return await asyncio.gather(*awaitables, return_exceptions=True)


def _is_number(x: Any) -> bool:
    """A numpy / torch scalar holding a real number."""
    try:
        return hasattr(x, "item") and isinstance(x.item(), (int, float)) and not isinstance(x.item(), bool)
    except Exception:  # noqa: BLE001
        return False


def _is_bool(x: Any) -> bool:
    try:
        return hasattr(x, "item") and isinstance(x.item(), bool)
    except Exception:  # noqa: BLE001
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80] + ' ...' if len(text) > 80 else text}"
