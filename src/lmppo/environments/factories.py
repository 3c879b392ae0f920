"""Environment classes in TRL 1.16's `environment_factory` shape, run unchanged, and the run's environment loaded
once: a built-in name or import path (`environment.path`), or Python objects passed to `PPOTrainer`.

TRL's shape (what `GRPOTrainer(environment_factory=...)` documents):

    env = MyEnv()                            one instance per episode, built with no arguments
    env.reset(**row_columns) -> str | None   text appended to the prompt's last user message (None: nothing)
    env.a_tool(...), env.another(...)        every other public method is a tool (sync or `async def`)
    env.get_reward() -> float                optional: once, when the episode has ended (sync or async)

`TrlEnvironment` wraps one such instance into lmppo's contract (`lmppo.environments.api`), so the episode loop and
the rollout do not change: the opening is the row's prompt with reset()'s text added; the methods (and the run's
`tools`) are offered as tools; a turn with tool calls gets their results as `tool` messages (a tool that raises: its
error is the message, the episode goes on); the first turn without a tool call ends the episode; `get_reward()` is
the contract's end-of-episode reward, on the last turn. At `environment.max_turns` that turn's calls are not run (as
TRL's `max_tool_calling_iterations` leaves the last generation's calls): the episode is truncated there, and
`get_reward()` is still called once.

Which contract a class follows is read once, from the class: `step` -> lmppo's, `reset` without `step` -> TRL's,
neither -> one error line. A dict of factories picks one per prompt row by the row's `environment` column (TRL's
routing).
"""

from __future__ import annotations

import asyncio
import inspect
import re
import types
from typing import Awaitable, Callable, Literal, Mapping, Optional, Protocol, Sequence, Union, cast

from lmppo.config import EnvironmentConfig
from lmppo.environments.api import (
    PYTHON_OBJECT,
    EnvironmentError,
    Factory,
    Messages,
    Tool,
    constructor_arguments,
    load_environment,
    load_tools,
)
from lmppo.environments.tools import RunsTools, Step, ToolBox, parse_tool_calls, tool_schemas, tool_step
from lmppo.errors import ConfigError

Factories = Union[Factory, Mapping[str, Factory]]
Kind = Literal["step", "reset"]  # lmppo's contract (`step`), TRL's environment_factory (`reset`, methods as tools)
ROUTE_COLUMN = "environment"  # the prompt column that picks a factory from a dict of them (TRL's name)
NOT_TOOLS = ("reset", "get_reward")
NOT_RUN: Messages = [{"role": "tool", "content": "error: environment.max_turns reached, the call was not run"}]


class TrlStyle(Protocol):
    """An instance of a TRL 1.16 environment class (its tools are its other public methods)."""

    def reset(self, **columns: object) -> object: ...


def environment_kind(factory: Factory, name: str, classless: Kind) -> Kind:
    """The contract `factory` builds environments for, read from its class; `classless`: the contract of a factory
    that is not a class (a function: lmppo's when the config names it, TRL's for `environment_factory=`)."""
    if not inspect.isclass(factory):
        return classless
    if callable(getattr(factory, "step", None)):
        return "step"
    if callable(getattr(factory, "reset", None)):
        return "reset"
    raise EnvironmentError(
        f"environment `{name}`: the class {factory.__qualname__} has neither `step` (lmppo's contract: "
        "Env(**row columns), reset(), step(text) -> (observation, reward, done)) nor `reset` (TRL's "
        "environment_factory: Env(), reset(**row columns), public methods as tools); see docs/environments.md"
    )


def tool_methods(instance: object) -> list[Tool]:
    """The tools of a TRL-style instance: its public methods other than `reset` and `get_reward`, by name."""
    cls = type(instance)
    names = [n for n in sorted(dir(cls)) if not n.startswith("_") and n not in NOT_TOOLS]
    return [getattr(instance, n) for n in names if _is_method(inspect.getattr_static(cls, n))]


def _is_method(attr: object) -> bool:
    """A function defined on the class (not a property, a nested class or a plain value)."""
    return inspect.isfunction(attr) or isinstance(attr, (staticmethod, classmethod))


def check_tool_schemas(tools: Sequence[Tool], what: str) -> None:
    """Every tool has a JSON schema (type hints and a docstring), checked once before any model loads: one error
    line naming the tool and what transformers' `get_json_schema` misses, instead of its traceback mid-run."""
    for fn in tools:
        try:
            tool_schemas([fn])
        except Exception as err:  # noqa: BLE001 - transformers' own error types; reported as one line
            name = getattr(fn, "__name__", repr(fn))
            raise EnvironmentError(
                f"{what} `{name}` cannot be offered to the model: {type(err).__name__}: {err} (a tool needs type hints "
                "and a Google-style docstring with an `Args:` line per argument; docs/environments.md#tools)"
            ) from None


def _unbound_tools(cls: type) -> list[Tool]:
    """A TRL-style class's tool methods as its instances will have them (bound: `self` is not an argument), read
    without building one."""
    names = [n for n in sorted(dir(cls)) if not n.startswith("_") and n not in NOT_TOOLS]
    out: list[Tool] = []
    for n in names:
        attr = inspect.getattr_static(cls, n)
        if inspect.isfunction(attr):
            out.append(types.MethodType(attr, object()))
        elif isinstance(attr, (staticmethod, classmethod)):
            out.append(getattr(cls, n))
    return out


def _settled(value: object) -> object:
    """A value, an awaitable one run to its end (an `async def reset`)."""
    return asyncio.run(_wait(value)) if inspect.isawaitable(value) else value


async def _wait(value: Awaitable[object]) -> object:
    return await value


class TrlEnvironment(RunsTools):
    """One episode of a TRL-style instance in lmppo's contract (module docstring). `columns`: the row's columns
    and `prompt`, passed to `reset`; `opening`: the row's prompt as chat messages; `tools`: the run's tools, offered
    after the instance's methods."""

    def __init__(
        self,
        instance: TrlStyle,
        columns: Mapping[str, object],
        opening: Messages,
        tools: Sequence[Tool],
        max_turns: int,
    ):
        self.instance, self.columns, self.opening, self.max_turns = instance, dict(columns), opening, max_turns
        self.tools = [*tool_methods(instance), *tools]
        self.toolbox = ToolBox(self.tools)
        self.turn = 0

    def reset(self) -> Messages:
        added = _settled(self.instance.reset(**self.columns))
        if added is not None and not isinstance(added, str):
            raise TypeError(f"reset() must return text or None, got {type(added).__name__} {added!r:.80}")
        messages = [dict(m) for m in self.opening]
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if added and users:
            messages[users[-1]]["content"] += added  # TRL adds it to the last user message as it is
        elif added:
            messages.append({"role": "user", "content": added})
        return messages

    def step(self, action: str) -> Step | Awaitable[Step]:
        self.turn += 1
        calls = parse_tool_calls(action)
        if not calls:
            return None, 0.0, True  # the answer: the episode ends (its reward is get_reward())
        if self.turn >= self.max_turns:
            return NOT_RUN, 0.0, False  # the loop truncates the episode here; nothing more reaches the model
        return tool_step(self.toolbox.answer(calls))

    def get_reward(self) -> object:
        get = getattr(self.instance, "get_reward", None)
        return get() if callable(get) else 0.0


class RunEnvironment:
    """The run's environment, loaded and checked once, before any model loads: its factories (one, or a dict by the
    `environment` column), the contract of each, the run's tools (`environment.tools` and `tools=` objects).
    `name`: as messages name it."""

    def __init__(self, name: str, factories: Factories, tools: Sequence[Tool], classless: Kind):
        self.name, self.tools = name, list(tools)
        self.routed = isinstance(factories, Mapping)
        self.factories: dict[str, Factory] = dict(factories) if isinstance(factories, Mapping) else {"": factories}
        if self.routed and not self.factories:
            raise EnvironmentError("environment_factory is an empty dict: give at least one name -> factory")
        bad = next((k for k, f in self.factories.items() if not isinstance(k, str) or not callable(f)), None)
        if bad is not None:
            raise EnvironmentError(
                f"environment_factory[{bad!r}] = {self.factories[bad]!r:.80}: must be a class (or a callable that "
                "builds an environment) under a string name"
            )
        self.kinds: dict[str, Kind] = {
            key: environment_kind(f, f"{name}[{key}]" if self.routed else name, classless)
            for key, f in self.factories.items()
        }
        check_tool_schemas(self.tools, "`environment.tools`: tool")
        for key, f in self.factories.items():
            if self.kinds[key] == "reset" and inspect.isclass(f):
                check_tool_schemas(_unbound_tools(f), f"tool method of {f.__qualname__}")

    def check_rows(self, columns: Sequence[Mapping[str, object]], where: Callable[[int], str]) -> None:
        """With a dict of factories, every prompt row names one of them in its `environment` column (one error line
        naming the row, its value and the names otherwise); `where(i)`: row i as messages name it."""
        if not self.routed:
            return
        for i in range(max(len(columns), 1)):
            value = columns[i].get(ROUTE_COLUMN) if i < len(columns) else None
            if not isinstance(value, str) or value not in self.factories:
                raise EnvironmentError(
                    f"{where(i)}: its `{ROUTE_COLUMN}` column is {value!r}, which environment_factory does not name "
                    f"(it has {', '.join(repr(k) for k in self.factories)})"
                )

    def builder(self, max_turns: int, opening: Callable[[object], tuple[Messages, object]]) -> "EpisodeBuilder":
        return EpisodeBuilder(self, max_turns, opening)


class EpisodeBuilder:
    """Builds one episode's environment from its row's columns (and `prompt`), as `EpisodeEnvironments` calls a
    factory: lmppo's contract with the columns it names (and `tools`), TRL's with no arguments, wrapped.
    `opening(prompt)`: the row's prompt as chat messages, and the prompt as TRL's `reset` gets it."""

    def __init__(self, run: RunEnvironment, max_turns: int, opening: Callable[[object], tuple[Messages, object]]):
        self.run, self.max_turns, self.opening = run, max_turns, opening

    def __call__(self, **columns: object) -> object:
        run = self.run
        key = str(columns.get(ROUTE_COLUMN)) if run.routed else ""
        factory = run.factories[key]
        if run.kinds[key] == "step":
            offered = {"tools": run.tools, **columns} if run.tools else columns
            return factory(**constructor_arguments(factory, offered))
        messages, prompt = self.opening(columns.get("prompt", ""))
        instance = factory()
        if not callable(getattr(instance, "reset", None)):
            raise TypeError(f"environment_factory built {type(instance).__name__}, which has no reset()")
        reset_columns = {**columns, "prompt": prompt}
        return TrlEnvironment(cast(TrlStyle, instance), reset_columns, messages, run.tools, self.max_turns)


def load_run_environment(
    cfg: EnvironmentConfig, factory: Optional[Factories] = None, tools: Sequence[Tool] = ()
) -> Optional[RunEnvironment]:
    """The run's environment from `environment.path` / `environment.tools`, or from the objects passed to
    `PPOTrainer` (`environment_factory=`, `tools=`: the config names them `python:...`); None without one."""
    if factory is None and not cfg.path:
        return None
    loaded = factory if factory is not None else load_environment(cfg.path)  # the environment's error line first
    bad = next((t for t in tools if not callable(t)), None)
    if bad is not None:
        raise EnvironmentError(f"tools=[...] holds {bad!r:.80}, which is not a function")
    named = [t for t in cfg.tools if not (tools and t.startswith(PYTHON_OBJECT))]
    all_tools = [*load_tools(named), *tools]
    if factory is not None:
        return RunEnvironment(cfg.path or python_name(factory), factory, all_tools, classless="reset")
    return RunEnvironment(cfg.path, loaded, all_tools, classless="step")


def python_name(obj: object) -> str:
    """How the config names a Python object passed to `PPOTrainer` (`python:MyEnv`; a dict: `python:{a: A, b: B}`)."""
    if isinstance(obj, Mapping):
        return PYTHON_OBJECT + "{" + ", ".join(f"{k}: {_qualname(v)}" for k, v in obj.items()) + "}"
    return PYTHON_OBJECT + _qualname(obj)


def _qualname(obj: object) -> str:
    return str(getattr(obj, "__qualname__", None) or type(obj).__qualname__)


def prompt_messages(text: str, tokenizer: object) -> tuple[Messages, object]:
    """The row's prompt (the text the policy is given) as chat messages, and as TRL's `reset` gets it (messages for
    a chat prompt, else the text): a prompt the chat template rendered from a user message (after an optional
    system message) is taken back out of the template; any other text is one user message."""
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos):
        text = text[len(bos) :]
    for roles in (("user",), ("system", "user")):
        contents = _template_contents(tokenizer, roles, text)
        if contents is not None:
            messages = [{"role": r, "content": c} for r, c in zip(roles, contents)]
            return messages, [dict(m) for m in messages]
    return [{"role": "user", "content": text}], text


_SLOT = "\x00lmppo-slot-{}\x00"


def _template_contents(tokenizer: object, roles: Sequence[str], text: str) -> Optional[list[str]]:
    """The contents of `roles` messages that the chat template renders as `text` (with the generation prompt), or
    None when it has no template or renders no such messages as `text`."""
    render = getattr(tokenizer, "apply_chat_template", None)
    if not getattr(tokenizer, "chat_template", None) or render is None:
        return None
    probe = [{"role": r, "content": _SLOT.format(i)} for i, r in enumerate(roles)]
    try:
        shape = str(render(probe, tokenize=False, add_generation_prompt=True))
    except Exception:  # noqa: BLE001 - a template that refuses this shape (e.g. no system role): not this shape
        return None
    pattern = re.escape(shape)
    for i in range(len(roles)):
        pattern = pattern.replace(re.escape(_SLOT.format(i)), "(.*)", 1)
    found = re.fullmatch(pattern, text, flags=re.DOTALL)
    return list(found.groups()) if found and len(found.groups()) == len(roles) else None


def name_python_objects(cfg: EnvironmentConfig, factory: Optional[Factories], tools: Sequence[Tool]) -> None:
    """Name in the config the objects passed to `PPOTrainer` (`environment_factory=`, `tools=`) as `python:...`, so
    the config stays text: it is saved with the run and compared on resume, and a resume or `lmppo eval` without the
    objects stops with one line saying to pass them (`lmppo.environments.api.load_environment`)."""
    if factory is not None:
        if cfg.path and not cfg.path.startswith(PYTHON_OBJECT):
            both = "and PPOTrainer(environment_factory=...) both give the environment: give one"
            raise ConfigError("environment.path", cfg.path, both)
        cfg.path = python_name(factory)
    if tools:
        cfg.tools = [*(t for t in cfg.tools if not t.startswith(PYTHON_OBJECT)), *(python_name(t) for t in tools)]
