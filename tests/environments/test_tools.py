"""Tools: schemas from type hints and docstrings, tool calls parsed from the model's text (malformed ones become
error observations), the built-in ToolEnvironment driven by a scripted policy, and observations appended token by
token through the chat template (with the glue after the end-of-turn token)."""

from __future__ import annotations

import pytest

from lmppo.environments.api import EnvironmentError, EpisodeEnvironments
from lmppo.environments.render import ChatObservations, observation_encoder
from lmppo.environments.tools import (
    ToolEnvironment,
    parse_tool_calls,
    plain_tool_prompt,
    run_tool_call,
    template_renders_tools,
    tool_schemas,
)


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


def test_schema_from_type_hints_and_docstring():
    (schema,) = tool_schemas([multiply])
    assert schema["function"]["name"] == "multiply"
    assert schema["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first factor"}
    assert schema["function"]["parameters"]["required"] == ["a", "b"]
    assert '"name": "multiply"' in plain_tool_prompt([schema])


def test_tool_calls_parsed_and_malformed_ones_reported():
    text = (
        'Let me compute. <tool_call>{"name": "multiply", "arguments": {"a": 17, "b": 23}}</tool_call> and '
        '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 4}}</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("multiply", {"a": 17, "b": 23}, ""),
        ("divide", {"a": 1, "b": 4}, ""),
    ]
    assert parse_tool_calls("The answer is 391.") == []
    assert "not valid JSON" in parse_tool_calls("<tool_call>{name: multiply}</tool_call>")[0].error
    assert "must be {" in parse_tool_calls('<tool_call>["multiply"]</tool_call>')[0].error
    assert "arguments must be" in parse_tool_calls('<tool_call>{"name": "m", "arguments": 3}</tool_call>')[0].error
    assert "not closed" in parse_tool_calls('<tool_call>{"name": "multiply"')[0].error
    tools = {"multiply": multiply, "divide": divide}
    assert run_tool_call(calls[0], tools) == ("391", False)
    assert run_tool_call(calls[1], tools) == ("0.25", False)
    bad = parse_tool_calls('<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>')[0]
    assert run_tool_call(bad, tools) == ("error: ZeroDivisionError: division by zero", True)
    unknown = parse_tool_calls('<tool_call>{"name": "add", "arguments": {}}</tool_call>')[0]
    assert run_tool_call(unknown, tools)[0] == "error: no tool named 'add' (tools: divide, multiply)"
    wrong_args = parse_tool_calls('<tool_call>{"name": "multiply", "arguments": {"x": 1}}</tool_call>')[0]
    assert run_tool_call(wrong_args, tools)[0].startswith("error: TypeError")


SCRIPT = [
    '<tool_call>{"name": "multiply", "arguments": {"a": 17, "b": 23}</tool_call>',  # malformed: a brace short
    '<tool_call>{"name": "multiply", "arguments": {"a": 17, "b": 23}}</tool_call>',
    "17 * 23 = 391",
]


def test_tool_environment_with_a_scripted_policy():
    """Three scripted turns: a malformed call (an error observation, not a crash), a good call (its result fed back
    as a tool message), then the answer (ends the episode, reward 1 against the `answer` column)."""
    envs = EpisodeEnvironments(
        ToolEnvironment, "tools", [{"prompt": "What is 17 * 23?", "answer": "391"}], [0], {"tools": [multiply]}
    )
    assert envs.reset() == [[{"role": "user", "content": "What is 17 * 23?"}]]
    assert [t.__name__ for t in envs.tools(0)] == ["multiply"]
    results = [envs.step([0], [action], turn=t)[0] for t, action in enumerate(SCRIPT, start=1)]
    assert results[0].observation[0]["role"] == "tool"
    assert results[0].observation[0]["content"].startswith("error: the tool call is not valid JSON")
    assert (results[0].reward, results[0].done) == (0.0, False)
    assert results[1].observation == [{"role": "tool", "content": "391"}]
    assert (results[2].observation, results[2].reward, results[2].done) == (None, 1.0, True)
    env = envs.envs[0]
    assert (env.tool_calls, env.tool_errors) == (2, 1)
    assert ToolEnvironment([multiply], answer="391").score("it is 390") == 0.0


def test_observations_appended_token_by_token_with_the_glue(tokenizer):
    """ChatML: after the policy's `<|im_end|>` the template's "\\n" and the new message follow; a turn cut at
    max_new_tokens is closed with `<|im_end|>` as context. The opening offers the tools in a plain system message
    (this template has no tool format)."""
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    enc = observation_encoder(tokenizer, stop, "auto")
    assert isinstance(enc, ChatObservations) and not template_renders_tools(tokenizer.chat_template)
    ids = enc.observation([{"role": "tool", "content": "391"}], turn_ended=True)
    assert tokenizer.decode(ids) == "\n<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n"
    cut = enc.observation([{"role": "user", "content": "Higher."}], turn_ended=False)
    assert cut[0] == stop[0] and tokenizer.decode(cut[1:]).startswith("\n<|im_start|>user\nHigher.")
    # the whole episode, rendered at once, is the same tokens: the opening, the sampled turn, the observation
    opening = enc.opening([{"role": "user", "content": "What is 17 * 23?"}], tool_schemas([multiply]))
    assert tokenizer.decode(opening).startswith("<|im_start|>system\nYou can call tools.")
    turn = tokenizer("I will call it", add_special_tokens=False)["input_ids"] + stop
    messages = [
        {
            "role": "system",
            "content": tokenizer.decode(opening).split("<|im_start|>system\n")[1].split("<|im_end|>")[0],
        },
        {"role": "user", "content": "What is 17 * 23?"},
        {"role": "assistant", "content": "I will call it"},
        {"role": "tool", "content": "391"},
    ]
    whole = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert opening + turn + ids == list(whole)


def test_a_template_that_is_not_prefix_preserving_is_refused(tokenizer):
    class Rewriting:
        chat_template = "x"

        def apply_chat_template(self, messages, add_generation_prompt, **kwargs):
            return [len(messages)] + [1] * len(messages) + [2]  # the first token changes with the length

    with pytest.raises(EnvironmentError, match="not prefix-preserving"):
        ChatObservations(Rewriting(), [2])


def test_a_stop_token_that_does_not_end_the_templates_turn_is_refused_naming_the_one_that_does(tokenizer):
    eos = tokenizer.eos_token_id
    assert tokenizer.convert_ids_to_tokens(eos) != "<|im_end|>"
    with pytest.raises(EnvironmentError) as info:
        ChatObservations(tokenizer, [eos])
    assert str(info.value).endswith(": set rollout.stop_token to `<|im_end|>`, the token it ends one with")


def test_text_rendering_appends_the_observation_as_plain_text(tokenizer):
    """environment.render `text`: no chat template; the opening and each observation are their text, encoded."""
    from lmppo.environments.render import Observations

    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    enc = observation_encoder(tokenizer, stop, "text")
    assert type(enc) is Observations
    assert tokenizer.decode(enc.observation([{"role": "user", "content": "Higher."}], turn_ended=True)) == "\nHigher.\n"
    assert tokenizer.decode(enc.opening([{"role": "user", "content": "Guess."}])) == "Guess."
    with_tools = tokenizer.decode(enc.opening([{"role": "user", "content": "Guess."}], tool_schemas([multiply])))
    assert "<|im_start|>" not in with_tools and "multiply" in with_tools


def test_the_config_tools_reach_the_environment(tmp_path):
    """environment.tools: the functions named there are imported and handed to the environment as `tools`."""
    from helpers_tokenizers import make_bpe_tokenizer
    from lmppo.config import EnvironmentConfig
    from lmppo.environments.episodes import EpisodePlayer

    path = tmp_path / "my_tools.py"
    path.write_text(
        "def add(a: int, b: int) -> int:\n    '''Add.\n\n    Args:\n        a: one\n"
        "        b: two\n    '''\n    return a + b\n"
    )
    tokenizer = make_bpe_tokenizer()
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    player = EpisodePlayer(EnvironmentConfig(path="tools", tools=[f"{path}:add"]), tokenizer, stop)
    assert [t.__name__ for t in player.tools] == ["add"]
    env = EpisodeEnvironments(player.factory, "tools", [{"prompt": "1 + 2?"}], [0], {"tools": player.tools})
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert env.step([0], [call], 1)[0].observation == [{"role": "tool", "content": "3"}]
