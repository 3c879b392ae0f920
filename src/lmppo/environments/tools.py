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

import json
import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Sequence

from lmppo.environments.api import Messages
from lmppo.environments.calls import CallTimeout, call_within

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MAX_RESULT_CHARS = 2000  # a tool result is cut to this many characters (a runaway output must not fill the episode)


def tool_schemas(tools: Sequence[Callable[..., Any]]) -> list[dict[str, Any]]:
    """The OpenAI-style JSON schema of each tool (transformers' `get_json_schema`: type hints + docstring)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(fn) for fn in tools]


def checked_tool_schemas(tools: Sequence[Callable[..., Any]]) -> list[dict[str, Any]]:
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


def plain_tool_prompt(schemas: Sequence[dict[str, Any]]) -> str:
    """The system message that offers tools to a model whose chat template has no tool format."""
    lines = "\n".join(json.dumps(s["function"], sort_keys=True) for s in schemas)
    return (
        "You can call tools. To call one, write exactly\n"
        '<tool_call>{"name": "TOOL_NAME", "arguments": {"ARG": VALUE}}</tool_call>\n'
        "and stop; its result comes back in a tool message. Answer without a tool call when you are done.\n"
        f"Tools:\n{lines}"
    )


def with_tool_prompt(messages: Messages, schemas: Sequence[dict[str, Any]]) -> Messages:
    """`messages` with `plain_tool_prompt` as the system message (added to the one there, or put first)."""
    text = plain_tool_prompt(schemas)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


@dataclass
class ToolCall:
    """One parsed call; `error` set (and name/arguments possibly empty) when the call is malformed."""

    name: str
    arguments: dict[str, Any]
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


def run_tool_call(call: ToolCall, tools: dict[str, Callable[..., Any]], timeout: float = 0.0) -> tuple[str, bool]:
    """The text of a call's result and whether it failed (malformed, unknown tool, bad arguments, the tool raised).
    A tool that runs past `timeout` seconds (0: no limit) raises CallTimeout: an environment failure, not the
    model's (`environment.on_error`); so does a tool that calls `sys.exit()`."""
    if call.error:
        return f"error: {call.error}", True
    fn = tools.get(call.name)
    if fn is None:
        return f"error: no tool named {call.name!r} (tools: {', '.join(sorted(tools))})", True
    try:
        result = call_within(partial(fn, **call.arguments), timeout, f"tool `{call.name}`")
    except CallTimeout:
        raise
    except Exception as err:  # noqa: BLE001 - the model's call failed: it sees why, the run goes on
        return f"error: {type(err).__name__}: {err}", True
    text = result if isinstance(result, str) else json.dumps(result, default=str)
    return text[:MAX_RESULT_CHARS], False


class ToolEnvironment:
    """The built-in tool-use environment (`environment.path: tools`).

    The episode opens with the row's prompt; each model turn with tool calls gets their results as `tool` messages
    (reward 0); the first turn without a tool call is the answer and ends the episode. Its reward: with an `answer`
    column, 1.0 when the last number of the answer (or, for a non-numeric answer, its stripped text) equals the
    column's value, else 0.0; without one, 0.0 (score the answer with `reward.sources` instead: they get the last
    turn's text as the completion). `tool_calls` and `tool_errors` count this episode's calls and failed calls.
    `tool_call_timeout`: each tool call's limit in seconds, which lmppo sets to `environment.step_timeout` (its
    `step` is lmppo's code: the tools are timed, one by one, not the step as a whole)."""

    tool_call_timeout: float = 0.0

    def __init__(self, tools: Sequence[Callable[..., Any]], prompt: str = "", answer: Any = None, **columns: Any):
        self.tools = list(tools)
        self.by_name = {fn.__name__: fn for fn in self.tools}
        self.prompt, self.answer = prompt, answer
        self.tool_calls = self.tool_errors = 0

    def reset(self) -> Optional[str]:
        return self.prompt or None

    def step(self, action: str) -> tuple[Optional[Messages], float, bool]:
        calls = parse_tool_calls(action)
        if not calls:
            return None, self.score(action), True
        messages = []
        for call in calls:
            text, failed = run_tool_call(call, self.by_name, self.tool_call_timeout)
            self.tool_calls += 1
            self.tool_errors += int(failed)
            messages.append({"role": "tool", "content": text})
        return messages, 0.0, False

    def score(self, answer_text: str) -> float:
        if self.answer is None:
            return 0.0
        expected = str(self.answer).strip()
        numbers = re.findall(r"-?\d+(?:\.\d+)?", answer_text.replace(",", ""))
        if re.fullmatch(r"-?\d+(?:\.\d+)?", expected):
            return float(bool(numbers) and float(numbers[-1]) == float(expected))
        return float(answer_text.strip() == expected)
