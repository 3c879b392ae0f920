"""Tools: Python functions with type hints and a docstring (TRL's `tools=` convention), offered to the model and run
by the built-in `ToolEnvironment`.

A tool's JSON schema comes from its signature and Google-style docstring (transformers' `get_json_schema`). The
model calls tools in the Hermes/Qwen format, one JSON object per call:

    <tool_call>{"name": "multiply", "arguments": {"a": 17, "b": 23}}</tool_call>

A tokenizer whose chat template renders `tools=` gets the schemas through it; one without (SmolLM2's) gets them in a
system message in the plain format of `plain_tool_prompt`. Each call's result (or its error) goes back to the model
as a `tool` message; a malformed call is such an error message, never an exception.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from dataclasses import dataclass
from functools import partial
from typing import Awaitable, Optional, Sequence

from lmppo.environments.api import Messages, Tool
from lmppo.environments.calls import CallTimeout, call_within

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
Step = tuple[Optional[Messages], float, bool]  # what `step` returns: (observation, reward, done)
JsonObject = dict[str, object]  # a JSON object: a tool's schema, a call's arguments
MAX_RESULT_CHARS = 2000  # a tool result is cut to this many characters (a runaway output must not fill the episode)


def tool_schemas(tools: Sequence[Tool]) -> list[JsonObject]:
    """The OpenAI-style JSON schema of each tool (transformers' `get_json_schema`: type hints + docstring)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(fn) for fn in tools]


def checked_tool_schemas(tools: Sequence[Tool]) -> list[JsonObject]:
    """`tool_schemas`, or one ValueError line naming the first tool transformers cannot describe and what it lacks
    (a docstring, a type hint, an argument's description under `Args:`)."""
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    schemas = []
    for fn in tools:
        try:
            schemas.extend(tool_schemas([fn]))
        except (DocstringParsingException, TypeHintParsingException) as err:
            name = getattr(fn, "__qualname__", None) or repr(fn)
            raise ValueError(
                f"tool `{name}` cannot be offered to the model: {err} (a tool needs a type hint on every argument "
                "and a Google-style docstring: a description, then `Args:` with one line per argument)"
            ) from None
    return schemas


def template_renders_tools(chat_template: Optional[str]) -> bool:
    """Whether a chat template uses the `tools` variable (else the tools go in a plain system message)."""
    return bool(chat_template) and re.search(r"\btools\b", str(chat_template)) is not None


def plain_tool_prompt(schemas: Sequence[JsonObject]) -> str:
    """The system message that offers tools to a model whose chat template has no tool format."""
    lines = "\n".join(json.dumps(s["function"], sort_keys=True) for s in schemas)
    return (
        "You can call tools. To call one, write exactly\n"
        '<tool_call>{"name": "TOOL_NAME", "arguments": {"ARG": VALUE}}</tool_call>\n'
        "and stop; its result comes back in a tool message. Answer without a tool call when you are done.\n"
        f"Tools:\n{lines}"
    )


def with_tool_prompt(messages: Messages, schemas: Sequence[JsonObject]) -> Messages:
    """`messages` with `plain_tool_prompt` as the system message (added to the one there, or put first)."""
    text = plain_tool_prompt(schemas)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


@dataclass
class ToolCall:
    """One parsed call; `error` set (and name/arguments possibly empty) when the call is malformed."""

    name: str
    arguments: JsonObject
    error: str = ""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls in a model turn, in order ([] when it makes none). A call that is not a JSON object with a
    string `name` and an object `arguments`, or a `<tool_call>` never closed, is a ToolCall with `error` set."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({err.msg})"))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(ToolCall("", {}, 'a tool call must be {"name": ..., "arguments": {...}}'))
            continue
        arguments = data.get("arguments", {})
        if not isinstance(arguments, dict):
            calls.append(ToolCall(data["name"], {}, "the tool call's arguments must be a JSON object"))
            continue
        calls.append(ToolCall(data["name"], arguments))
    if text.count("<tool_call>") > text.count("</tool_call>"):
        calls.append(ToolCall("", {}, "a <tool_call> was not closed with </tool_call>"))
    return calls


def run_tool_call(call: ToolCall, tools: dict[str, Tool], timeout: float = 0.0) -> tuple[str, bool]:
    """The text of a call's result and whether it failed (malformed, unknown tool, bad arguments, the tool raised).
    An `async def` tool is run to its end here (`ToolBox` runs the async ones of a turn in the turn's event loop).
    `timeout`: `_start`'s."""
    started = _start(call, tools, timeout)
    if inspect.isawaitable(started):
        return asyncio.run(_finish(started))
    return _settle(started)


@dataclass
class _Failure:
    text: str  # what the model is told


def _start(call: ToolCall, tools: dict[str, Tool], timeout: float = 0.0) -> object:
    """A `_Failure` for a call that failed at once; else what the tool returned (an awaitable for an async tool).
    With `timeout` > 0 (`environment.step_timeout`) the call, sync or async, runs to its end in a thread within it;
    past it, or calling `sys.exit()`, it raises (CallTimeout, SystemExit): an environment failure, not the model's."""
    if call.error:
        return _Failure(f"error: {call.error}")
    fn = tools.get(call.name)
    if fn is None:
        return _Failure(f"error: no tool named {call.name!r} (tools: {', '.join(sorted(tools))})")
    try:
        if timeout > 0:
            return call_within(partial(fn, **call.arguments), timeout, f"tool `{call.name}`")
        return fn(**call.arguments)
    except CallTimeout:
        raise
    except Exception as err:  # noqa: BLE001 - the model's call failed: it sees why, the run goes on
        return _Failure(_error_text(err))


def _settle(started: object) -> tuple[str, bool]:
    """(text, failed) of a call that returned (not an awaitable)."""
    return (started.text, True) if isinstance(started, _Failure) else (_result_text(started), False)


async def _finish(started: Awaitable[object]) -> tuple[str, bool]:
    try:
        return _result_text(await started), False
    except Exception as err:  # noqa: BLE001 - as for a sync tool
        return _error_text(err), True


def _error_text(err: Exception) -> str:
    return f"error: {type(err).__name__}: {err}"


def _result_text(result: object) -> str:
    text = result if isinstance(result, str) else json.dumps(result, default=str)
    return text[:MAX_RESULT_CHARS]


class ToolBox:
    """Runs the tool calls of a model turn against named functions, sync or `async def`, and counts them.

    `answer(calls)` gives one `tool` message per call, in order (a result, or the error the model sees); when a
    called tool is async it gives an awaitable of those messages instead, for the turn's event loop to run."""

    def __init__(self, tools: Sequence[Tool], timeout: float = 0.0):
        self.by_name = {fn.__name__: fn for fn in tools}
        self.calls = self.errors = 0
        self.timeout = timeout  # each call's limit (`_start`), set through the environment's `tool_call_timeout`

    def answer(self, calls: Sequence[ToolCall]) -> Messages | Awaitable[Messages]:
        started = [_start(call, self.by_name, self.timeout) for call in calls]
        self.calls += len(calls)
        if any(inspect.isawaitable(s) for s in started):
            return self._answer_later(started)
        return self._messages([_settle(s) for s in started])

    async def _answer_later(self, started: list[object]) -> Messages:
        # one after another, in the order the model called them
        return self._messages([await _finish(s) if inspect.isawaitable(s) else _settle(s) for s in started])

    def _messages(self, results: Sequence[tuple[str, bool]]) -> Messages:
        self.errors += sum(failed for _, failed in results)
        return [{"role": "tool", "content": text} for text, _ in results]


class RunsTools:
    """What an environment that runs the model's tool calls through a `ToolBox` (`self.toolbox`) shows lmppo:
    `tool_call_timeout` (lmppo times each tool call, not the step as a whole) and the episode's call counts."""

    toolbox: ToolBox

    @property
    def tool_call_timeout(self) -> float:
        return self.toolbox.timeout

    @tool_call_timeout.setter
    def tool_call_timeout(self, seconds: float) -> None:
        self.toolbox.timeout = seconds

    @property
    def tool_calls(self) -> int:
        return self.toolbox.calls

    @property
    def tool_errors(self) -> int:
        return self.toolbox.errors


class ToolEnvironment(RunsTools):
    """The built-in tool-use environment (`environment.path: tools`).

    The episode opens with the row's prompt; each model turn with tool calls gets their results as `tool` messages
    (reward 0); the first turn without a tool call is the answer and ends the episode. Its reward: with an `answer`
    column, 1.0 when the last number of the answer (or, for a non-numeric answer, its stripped text) equals the
    column's value, else 0.0; without one, 0.0 (score the answer with `reward.sources` instead: they get the last
    turn's text as the completion). `tool_calls` and `tool_errors` count this episode's calls and failed calls.
    `tool_call_timeout`: each tool call's limit in seconds, which lmppo sets to `environment.step_timeout` (its
    `step` is lmppo's code: the tools are timed, one by one, not the step as a whole)."""

    def __init__(self, tools: Sequence[Tool], prompt: str = "", answer: object = None, **columns: object):
        self.tools = list(tools)
        self.toolbox = ToolBox(self.tools)
        self.prompt, self.answer = prompt, answer

    def reset(self) -> Optional[str]:
        return self.prompt or None

    def step(self, action: str) -> Step | Awaitable[Step]:
        calls = parse_tool_calls(action)
        if not calls:
            return None, self.score(action), True
        return tool_step(self.toolbox.answer(calls))

    def score(self, answer_text: str) -> float:
        if self.answer is None:
            return 0.0
        expected = str(self.answer).strip()
        numbers = re.findall(r"-?\d+(?:\.\d+)?", answer_text.replace(",", ""))
        if re.fullmatch(r"-?\d+(?:\.\d+)?", expected):
            return float(bool(numbers) and float(numbers[-1]) == float(expected))
        return float(answer_text.strip() == expected)


def tool_step(answered: Messages | Awaitable[Messages]) -> Step | Awaitable[Step]:
    """The step of a turn whose tool calls were answered: their messages as the observation, reward 0, not done (an
    awaitable step when the answer is one: async tools)."""
    if inspect.isawaitable(answered):
        return _tool_step_later(answered)
    return answered, 0.0, False


async def _tool_step_later(answered: Awaitable[Messages]) -> Step:
    return await answered, 0.0, False
