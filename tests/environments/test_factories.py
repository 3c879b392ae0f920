"""Environment classes in TRL 1.16's `environment_factory` shape, run unchanged (`lmppo.environments.factories`):
built with no arguments, `reset(**row)` adding to the prompt, public methods as sync and async tools, the episode
ending at the first turn without a tool call or at max_turns, `get_reward()` once at the end; a dict of factories
by the `environment` column; the error lines. A scripted policy plays the turns."""

from __future__ import annotations

import asyncio

import pytest

from lmppo.config import EnvironmentConfig
from lmppo.environments.api import PYTHON_OBJECT, EnvironmentError, load_environment
from lmppo.environments.episodes import EpisodePlayer
from lmppo.environments.factories import (
    RunEnvironment,
    environment_kind,
    load_run_environment,
    name_python_objects,
    prompt_messages,
)
from lmppo.errors import ConfigError

INC = '<tool_call>{"name": "increment", "arguments": {"by": 2}}</tool_call>'
DOUBLE = '<tool_call>{"name": "double", "arguments": {}}</tool_call>'
EXPLODE = '<tool_call>{"name": "explode", "arguments": {}}</tool_call>'
MULTIPLY = '<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 5}}</tool_call>'


class Counter:
    """A TRL-style environment: a counter the model changes with tools; reward 1 when it ends on the row's target."""

    built: list["Counter"] = []

    def __init__(self):
        self.count, self.target, self.rewards_asked = 0, 0, 0
        self.columns: dict = {}
        Counter.built.append(self)

    def reset(self, **columns):
        self.columns = columns
        self.count, self.target = int(columns["start"]), int(columns["target"])
        return f" Start at {self.count}."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much to add
        """
        self.count += by
        return self.count

    async def double(self) -> int:
        """Double the counter."""
        await asyncio.sleep(0)
        self.count *= 2
        return self.count

    def explode(self) -> str:
        """Always fails."""
        raise ValueError("boom")

    async def get_reward(self) -> float:
        self.rewards_asked += 1
        return float(self.count == self.target)

    def _helper(self) -> None:
        raise AssertionError("a private method is not a tool")

    @property
    def value(self) -> int:
        return self.count


class Quiet:
    """TRL-style: reset returns None, no get_reward."""

    def reset(self, **columns) -> None:
        return None

    def ping(self) -> str:
        """Answer pong."""
        return "pong"


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


class Scripted:
    """Plays fixed turn texts (each encoded, then the stop token)."""

    def __init__(self, tokenizer, stop, script):
        self.tokenizer, self.stop, self.script = tokenizer, stop, script

    def _turn(self, k, rows):
        return [
            self.tokenizer(self.script[b][k], add_special_tokens=False)["input_ids"] + [self.stop] if on else []
            for b, on in enumerate(rows)
        ]

    def first(self, prompts, seeds):
        return self._turn(0, [True] * len(prompts))

    def next(self, observations, turn):
        return self._turn(turn, [o is not None for o in observations])


@pytest.fixture(autouse=True)
def _fresh_counters():
    Counter.built.clear()


def play(tokenizer, factory, script, columns, tools=(), max_turns=3):
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = EnvironmentConfig(max_turns=max_turns, max_episode_tokens=1000, max_observation_tokens=64)
    player = EpisodePlayer(cfg, tokenizer, [stop], load_run_environment(cfg, factory=factory, tools=tools))
    n = len(columns)
    return player.play(Scripted(tokenizer, stop, script), [[1]] * n, columns, list(range(n)), [0] * n)


def test_tools_run_until_a_turn_without_a_call_and_get_reward_is_that_turns_reward(tokenizer):
    rows = [{"prompt": "count", "start": 1, "target": 6}, {"prompt": "count", "start": 1, "target": 1}]
    won, failed = play(tokenizer, Counter, [[INC, DOUBLE, "done"], [EXPLODE, "done", "unused"]], rows)
    # a sync tool, then an async one: 1 + 2 = 3, 3 * 2 = 6 (the target): reward 1 on the last turn only
    assert won.transcript == [INC, "3", DOUBLE, "6", "done"]
    assert won.turn_rewards == [0.0, 0.0, 1.0] and won.stop_reason == "environment"
    assert (won.tool_calls, won.tool_errors) == (2, 0)
    # a tool that raises: its error is the tool message, the episode goes on to the answer
    assert failed.transcript == [EXPLODE, "error: ValueError: boom", "done"]
    assert failed.turn_rewards == [0.0, 1.0] and (failed.tool_calls, failed.tool_errors) == (1, 1)
    # one instance per episode, built with no arguments; reset got every column, prompt included; get_reward once
    assert len(Counter.built) == 2 and [c.rewards_asked for c in Counter.built] == [1, 1]
    assert Counter.built[0].columns == {"prompt": "count", "start": 1, "target": 6}


def test_at_max_turns_the_last_calls_are_not_run_and_get_reward_is_still_called_once(tokenizer):
    (episode,) = play(tokenizer, Counter, [[INC, INC, INC]], [{"prompt": "count", "start": 0, "target": 4}])
    assert episode.stop_reason == "max_turns" and len(episode.turn_ends) == 3
    (counter,) = Counter.built
    assert counter.count == 4  # 0 + 2 + 2: the third turn's call was not run (TRL's last generation)
    assert counter.rewards_asked == 1 and episode.turn_rewards == [0.0, 0.0, 1.0]
    assert episode.tool_calls == 2


def test_the_opening_is_the_prompt_with_resets_text_and_the_public_methods_as_tools(tokenizer):
    (episode,) = play(tokenizer, Counter, [["done"]], [{"prompt": "count", "start": 7, "target": 7}], [multiply])
    opening = tokenizer.decode(episode.prompt)
    assert opening.endswith("<|im_start|>user\ncount Start at 7.<|im_end|>\n<|im_start|>assistant\n")
    offered = opening[: opening.index("<|im_start|>user")]
    for name in ("double", "explode", "increment", "multiply"):  # the methods, then the run's tools
        assert f'"name": "{name}"' in offered
    for name in ("reset", "get_reward", "_helper", "value"):
        assert f'"name": "{name}"' not in offered
    assert episode.turn_rewards == [1.0]


def test_reset_returning_none_keeps_the_prompt_and_no_get_reward_is_reward_zero(tokenizer):
    (episode,) = play(tokenizer, Quiet, [['<tool_call>{"name": "ping", "arguments": {}}</tool_call>', "ok"]], [{}])
    assert tokenizer.decode(episode.prompt).endswith("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n")
    assert episode.transcript[1] == "pong" and episode.turn_rewards == [0.0, 0.0]


def test_the_runs_tools_are_offered_with_the_methods(tokenizer):
    (episode,) = play(tokenizer, Quiet, [[MULTIPLY, "15"]], [{"prompt": "3 * 5?"}], tools=[multiply])
    assert episode.transcript == [MULTIPLY, "15", "15"]


def test_a_chat_prompt_is_taken_back_out_of_the_template(tokenizer):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "count"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt_messages(text, tokenizer) == (chat, chat)  # reset gets the messages, as TRL gives them
    one = tokenizer.apply_chat_template(chat[1:], tokenize=False, add_generation_prompt=True)
    assert prompt_messages(one, tokenizer) == (chat[1:], chat[1:])
    assert prompt_messages("count", tokenizer) == ([{"role": "user", "content": "count"}], "count")
    (episode,) = play(tokenizer, Counter, [["done"]], [{"prompt": text, "start": 2, "target": 2}])
    opening = tokenizer.decode(episode.prompt)
    assert opening.startswith("<|im_start|>system\nBe brief.\n\nYou can call tools.")  # the tools join the system
    assert opening.endswith("<|im_end|>\n<|im_start|>user\ncount Start at 2.<|im_end|>\n<|im_start|>assistant\n")
    assert Counter.built[0].columns["prompt"] == chat


def test_a_dict_of_factories_is_picked_by_the_environment_column(tokenizer):
    rows = [
        {"prompt": "count", "environment": "counter", "start": 1, "target": 3},
        {"prompt": "ping", "environment": "quiet"},
    ]
    counted, pinged = play(tokenizer, {"counter": Counter, "quiet": Quiet}, [[INC, "done"], ["ok", "unused"]], rows)
    assert counted.transcript[1] == "3" and counted.turn_rewards == [0.0, 1.0]
    assert pinged.turn_rewards == [0.0] and len(Counter.built) == 1
    run = load_run_environment(EnvironmentConfig(), factory={"counter": Counter, "quiet": Quiet})
    run.check_rows(rows, lambda i: f"item {i}")
    bad = [rows[0], {"prompt": "x", "environment": "wordle"}]
    with pytest.raises(
        EnvironmentError, match=r"^item 1: its `environment` column is 'wordle', which .*'counter', 'quiet'"
    ):
        run.check_rows(bad, lambda i: f"item {i}")
    with pytest.raises(EnvironmentError, match=r"item 0: its `environment` column is None"):
        run.check_rows([{"prompt": "x"}], lambda i: f"item {i}")


def test_the_kind_of_class_is_read_once_and_a_class_with_neither_is_one_error_line(tokenizer):
    class Neither:
        def act(self, text):
            return text

    assert environment_kind(Counter, "c", classless="step") == "reset"
    assert environment_kind(load_environment("guess_number"), "guess_number", classless="step") == "step"
    assert environment_kind(lambda **row: None, "fn", classless="step") == "step"
    with pytest.raises(
        EnvironmentError, match=r"environment `my_env.py:Neither`: the class .*Neither has neither `step`"
    ):
        RunEnvironment("my_env.py:Neither", Neither, [], classless="step")


def test_get_reward_that_raises_or_returns_no_number_is_one_error_line(tokenizer):
    class Raises(Quiet):
        def get_reward(self):
            raise RuntimeError("no score")

    class Text(Quiet):
        async def get_reward(self):
            return "high"

    pattern = r"environment `python:.*Raises`, prompt row 0, turn 1: get_reward\(\) raised RuntimeError: no score"
    with pytest.raises(EnvironmentError, match=pattern):
        play(tokenizer, Raises, [["ok"]], [{}])
    with pytest.raises(EnvironmentError, match=r"turn 1: get_reward\(\) must return a number, got str 'high'"):
        play(tokenizer, Text, [["ok"]], [{}])


def test_python_objects_are_named_in_the_config_and_a_run_without_them_says_so():
    cfg = EnvironmentConfig(tools=["my_tools.py:add"])
    name_python_objects(cfg, Counter, [multiply])
    assert cfg.path == PYTHON_OBJECT + "Counter" and cfg.tools == ["my_tools.py:add", "python:multiply"]
    name_python_objects(cfg, Counter, [multiply])  # a resume passes them again: the same names
    assert cfg.tools == ["my_tools.py:add", "python:multiply"]
    routed = EnvironmentConfig()
    name_python_objects(routed, {"a": Counter, "b": Quiet}, [])
    assert routed.path == "python:{a: Counter, b: Quiet}"
    with pytest.raises(
        ConfigError, match=r"environment.path.*python:Counter.*PPOTrainer\(\.\.\., environment_factory="
    ):
        load_run_environment(EnvironmentConfig(path="python:Counter"))
    with pytest.raises(ConfigError, match=r"environment.tools.*python:multiply.*tools="):
        load_run_environment(EnvironmentConfig(path="tools", tools=["python:multiply"]))
    with pytest.raises(ConfigError, match="both give the environment"):
        name_python_objects(EnvironmentConfig(path="guess_number"), Counter, [])


def test_python_tools_work_with_the_builtin_tools_environment_and_async_tools(tokenizer):
    async def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b

    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = EnvironmentConfig(path="tools", max_turns=3, max_episode_tokens=1000, max_observation_tokens=64)
    player = EpisodePlayer(cfg, tokenizer, [stop], load_run_environment(cfg, tools=[multiply, add]))
    script = [[MULTIPLY, '<tool_call>{"name": "add", "arguments": {"a": 15, "b": 1}}</tool_call>', "16"]]
    (episode,) = player.play(Scripted(tokenizer, stop, script), [[1]], [{"prompt": "3*5+1?", "answer": "16"}], [0], [0])
    assert episode.transcript[1] == "15" and episode.transcript[3] == "16"
    assert episode.turn_rewards == [0.0, 0.0, 1.0] and episode.tool_calls == 2


def test_a_tool_without_a_schema_is_one_error_line_before_any_episode():
    class Undocumented(Quiet):
        def guess(self, n: int) -> str:
            return str(n)

    def no_hints(a, b):
        """Add.

        Args:
            a: one
            b: two
        """
        return a + b

    with pytest.raises(
        EnvironmentError, match=r"^tool method of .*Undocumented `guess` cannot be offered to the model: "
    ):
        load_run_environment(EnvironmentConfig(), factory=Undocumented)
    named = r"^`environment.tools`: tool `no_hints` cannot be offered to the model: .*type hints"
    with pytest.raises(EnvironmentError, match=named):
        load_run_environment(EnvironmentConfig(), factory=Quiet, tools=[no_hints])
    load_run_environment(EnvironmentConfig(), factory=Counter, tools=[multiply])  # documented: accepted
