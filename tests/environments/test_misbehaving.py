"""Environments that misbehave (issue 50, item 5): a call that never returns (sync, async, an `async def` that
blocks, a tool) is cut at `environment.step_timeout`; `sys.exit()` is one line; `on_error: drop` ends only the
failed episode, up to `max_drop_fraction`; `concurrency` runs one turn's steps at once. Every failure is produced
for real: steps that really hang, really exit, really raise."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest
from test_environments_episodes import Scripted

from conftest import REPO
from lmppo.config import EnvironmentConfig
from lmppo.environments.api import EnvironmentError, EpisodeEnvironments
from lmppo.environments.episodes import play_episodes
from lmppo.environments.render import observation_encoder
from lmppo.environments.tools import ToolEnvironment

FOREVER = threading.Event()  # never set: waiting on it is a call that never returns


class Fine:
    """Two turns of reward 0.5 each; the rows' `hang` / `fail` columns pick the turn (0: never) of a misbehaviour."""

    def __init__(self, prompt: str = "", hang: int = 0, fail: int = 0, exit_at: int = 0):
        self.hang, self.fail, self.exit_at, self.seen = hang, fail, exit_at, 0

    def reset(self):
        return "go"

    def step(self, action):
        self.seen += 1
        if self.seen == self.hang:
            FOREVER.wait()
        if self.seen == self.fail:
            raise RuntimeError("the sandbox went away")
        if self.seen == self.exit_at:
            sys.exit(3)
        return ("again" if self.seen < 2 else None), 0.5, self.seen >= 2


class AsyncHangs(Fine):
    async def step(self, action):
        if self.seen + 1 == self.hang:
            await asyncio.sleep(10**6)
        return Fine.step(self, action)


class AsyncBlocks(Fine):
    """An `async def` that blocks its event loop (a sync sleep inside): asyncio's timeout cannot fire."""

    async def step(self, action):
        if self.seen + 1 == self.hang:
            FOREVER.wait()
        return Fine.step(self, action)


class HangsInReset(Fine):
    def reset(self):
        FOREVER.wait()


class HangsWhenBuilt(Fine):
    def __init__(self, **columns):
        FOREVER.wait()


def envs(factory, rows, **settings):
    return EpisodeEnvironments(
        factory, "my_env.py:Env", rows, list(range(len(rows))), None, EnvironmentConfig(**settings)
    )


@pytest.mark.parametrize("factory", [Fine, AsyncHangs, AsyncBlocks])
def test_a_step_that_never_returns_is_one_line_naming_the_environment_row_turn_and_limit(factory):
    batch = envs(factory, [{}, {"hang": 2}, {}], step_timeout=0.3)
    assert [r.reward for r in batch.step([0, 1, 2], ["a", "b", "c"], 1)] == [0.5, 0.5, 0.5]
    with pytest.raises(EnvironmentError) as info:
        batch.step([0, 1, 2], ["a", "b", "c"], 2)
    assert str(info.value) == (
        "environment `my_env.py:Env`, prompt row 1, turn 2: step() did not return within environment.step_timeout "
        "(0.3 s)"
    )


def test_reset_and_building_are_timed_too():
    with pytest.raises(EnvironmentError, match=r"prompt row 0, reset: reset\(\) did not return within .* \(0.2 s\)"):
        envs(HangsInReset, [{}], step_timeout=0.2).reset()
    with pytest.raises(EnvironmentError, match=r"prompt row 0, reset: building it did not return within"):
        envs(HangsWhenBuilt, [{}], step_timeout=0.2)


def test_sys_exit_in_a_step_is_one_line_not_the_end_of_the_process():
    batch = envs(Fine, [{"exit_at": 1}])
    with pytest.raises(EnvironmentError) as info:
        batch.step([0], ["a"], 1)
    assert str(info.value).startswith(
        "environment `my_env.py:Env`, prompt row 0, turn 1: step() raised SystemExit (it called sys.exit(3)"
    )


def test_a_keyboard_interrupt_raised_by_the_environment_still_stops_like_ctrl_c():
    class Interrupts(Fine):
        def step(self, action):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        envs(Interrupts, [{}]).step([0], ["a"], 1)


class Slow:
    """Records when each of its steps ran (monotonic clock), sleeping inside."""

    spans: list[tuple[float, float]] = []

    def __init__(self, **columns):
        pass

    def reset(self):
        return "go"

    def step(self, action):
        start = time.monotonic()
        time.sleep(0.2)
        Slow.spans.append((start, time.monotonic()))
        return None, 0.0, True


@pytest.mark.parametrize("concurrency", [1, 4])
def test_one_turns_sync_steps_overlap_up_to_concurrency(concurrency):
    """With 4: every step's running interval overlaps every other's; with 1: none overlaps another."""
    Slow.spans = []
    envs(Slow, [{}] * 4, concurrency=concurrency).step([0, 1, 2, 3], ["a"] * 4, 1)
    spans = sorted(Slow.spans)
    overlapping = [a_end > b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])]
    assert overlapping == [concurrency > 1] * 3
    if concurrency > 1:
        assert max(s for s, _ in spans) < min(e for _, e in spans)  # all four were running at one moment


def slow_tool(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    if seconds > 100:
        FOREVER.wait()
    time.sleep(seconds)
    return "slept"


def test_each_tool_call_is_timed_not_the_tool_environments_step():
    """Three calls of 0.15 s under a limit of 0.3 s each: the step (0.45 s) goes on; a call that hangs is the
    environment's failure naming the tool."""
    calls = "".join(
        '<tool_call>{"name": "slow_tool", "arguments": {"seconds": %s}}</tool_call>' % s for s in [0.15] * 3
    )
    batch = EpisodeEnvironments(
        ToolEnvironment, "tools", [{}, {}], [0, 1], {"tools": [slow_tool]}, EnvironmentConfig(step_timeout=0.3)
    )
    hang = '<tool_call>{"name": "slow_tool", "arguments": {"seconds": 1000}}</tool_call>'
    with pytest.raises(EnvironmentError) as info:
        batch.step([0, 1], [calls, hang], 1)
    assert str(info.value) == (
        "environment `tools`, prompt row 1, turn 1: tool `slow_tool` did not return within environment.step_timeout "
        "(0.3 s)"
    )
    assert batch.envs[0].tool_calls == 3 and batch.envs[0].tool_errors == 0


def play(tokenizer, rows, script, **settings):
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = EnvironmentConfig(max_turns=3, **settings)
    batch = EpisodeEnvironments(Fine, "my_env.py:Env", rows, list(range(len(rows))), None, cfg)
    sampler = Scripted(tokenizer, stop, script)
    encoder = observation_encoder(tokenizer, [stop], "chat")
    return play_episodes(batch, sampler, encoder, tokenizer, [[1]] * len(rows), [0] * len(rows), cfg, [stop])


def test_drop_ends_only_the_failed_episode_and_warns_once(tokenizer):
    rows = [{}, {"fail": 2}, {"hang": 1}, {}, {}]
    script = [["a", "b", "c"]] * 5
    with pytest.warns(UserWarning) as caught:
        played = play(tokenizer, rows, script, on_error="drop", step_timeout=0.3)
    assert [e.stop_reason for e in played] == ["environment", "dropped", "dropped", "environment", "environment"]
    assert [e.turn_rewards for e in played] == [[0.5, 0.5], [0.5, 0.0], [0.0], [0.5, 0.5], [0.5, 0.5]]
    assert [len(e.turn_ends) for e in played] == [2, 2, 1, 2, 2]
    assert [str(w.message) for w in caught] == [
        "dropped 2 of 5 episodes (environment.on_error: drop); the first: environment `my_env.py:Env`, prompt row 1, "
        "turn 2: step() raised RuntimeError: the sandbox went away"
    ]


def test_stop_is_the_default_and_raises_the_first_failure(tokenizer):
    with pytest.raises(EnvironmentError, match="prompt row 1, turn 2: step"):
        play(tokenizer, [{}, {"fail": 2}], [["a", "b"]] * 2)


def test_more_than_max_drop_fraction_stops_the_run(tokenizer):
    rows = [{"fail": 1}, {"fail": 2}, {}, {}]
    assert len(play(tokenizer, rows, [["a", "b"]] * 4, on_error="drop", max_drop_fraction=0.5)) == 4  # 2 of 4: ok
    rows[2] = {"exit_at": 1}
    with pytest.raises(EnvironmentError) as info:
        play(tokenizer, rows, [["a", "b"]] * 4, on_error="drop", max_drop_fraction=0.5)
    assert str(info.value).startswith(
        "3 of 4 episodes of the batch failed, more than environment.max_drop_fraction (0.5); the first: "
        "environment `my_env.py:Env`, prompt row 0, turn 1: step() raised RuntimeError"
    )


HUNG_PROCESS = """
import sys, threading
sys.path.insert(0, {tests!r})
from lmppo.config import EnvironmentConfig
from lmppo.environments.api import EnvironmentError, EpisodeEnvironments
from test_misbehaving import Fine
batch = EpisodeEnvironments(Fine, "env", [{{"hang": 1}}], [0], None, EnvironmentConfig(step_timeout=0.2))
try:
    batch.step([0], ["a"], 1)
except EnvironmentError as err:
    print(err)
print("threads left running:", threading.active_count() - 1)
"""


def test_the_process_exits_with_a_hung_call_still_running():
    """The abandoned call's thread is a daemon: the interpreter ends without waiting for it."""
    tests = os.path.join(REPO, "tests")
    done = subprocess.run(
        [sys.executable, "-c", HUNG_PROCESS.format(tests=os.path.join(tests, "environments"))],
        capture_output=True,
        text=True,
        timeout=120,  # a guard against a hang, not a measurement
        env=dict(os.environ, PYTHONPATH=f"{REPO}/src{os.pathsep}{tests}"),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "environment `env`, prompt row 0, turn 1: step() did not return within environment.step_timeout (0.2 s)",
        "threads left running: 1",
    ]


class TrlShaped:
    """TRL 1.16's environment_factory shape: `reset`, public methods as tools."""

    def reset(self, **columns):
        return None

    def wait(self) -> str:
        """Waits forever."""
        FOREVER.wait()
        return "never"


def test_a_trl_style_classs_tool_methods_are_timed_one_by_one():
    from lmppo.environments.factories import TrlEnvironment

    def build(**columns):
        return TrlEnvironment(TrlShaped(), columns, [{"role": "user", "content": "go"}], [], 4)

    batch = EpisodeEnvironments(build, "trl.py:TrlShaped", [{}], [0], None, EnvironmentConfig(step_timeout=0.2))
    batch.reset()
    with pytest.raises(EnvironmentError) as info:
        batch.step([0], ['<tool_call>{"name": "wait", "arguments": {}}</tool_call>'], 1)
    assert str(info.value) == (
        "environment `trl.py:TrlShaped`, prompt row 0, turn 1: tool `wait` did not return within "
        "environment.step_timeout (0.2 s)"
    )
