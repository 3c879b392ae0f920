"""The environment contract, checked: one instance per episode built from the row's columns, reset/step, async
steps, and one error line naming the environment, the prompt row and the turn for every way an environment fails."""

from __future__ import annotations

import textwrap

import pytest

from lmppo.environments.api import EnvironmentError, EpisodeEnvironments, load_environment

ENV_FILE = '''
import asyncio

class Counter:
    """Rewards 0.5 per turn, ends after `turns` turns; echoes the action back."""
    def __init__(self, turns, prompt="", **columns):
        self.turns, self.seen, self.prompt = int(turns), 0, prompt

    def reset(self):
        return self.prompt

    def step(self, action):
        self.seen += 1
        done = self.seen >= self.turns
        return (None if done else f"you said {action}"), 0.5, done

class AsyncCounter(Counter):
    async def step(self, action):
        await asyncio.sleep(0)
        return Counter.step(self, action)

class Broken(Counter):
    def step(self, action):
        self.seen += 1
        if self.seen == 2:
            raise ValueError("boom")
        return "ok", 0.0, False

class WrongType(Counter):
    def step(self, action):
        return "ok", 0.0

class NanReward(Counter):
    def step(self, action):
        return "ok", float("nan"), False

class NotDone(Counter):
    def step(self, action):
        return None, 0.0, False

class Messages(Counter):
    def reset(self):
        return [{"role": "system", "content": "be brief"}, {"role": "user", "content": self.prompt}]
    def step(self, action):
        return [{"role": "tool", "content": "42"}], 1, False
'''


@pytest.fixture()
def env_file(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(textwrap.dedent(ENV_FILE))
    return str(path)


def envs(env_file, name, rows=({"turns": 2, "prompt": "hi"}, {"turns": 1, "prompt": "yo"})):
    spec = f"{env_file}:{name}"
    return EpisodeEnvironments(load_environment(spec), spec, list(rows), rows=[7, 9])


def test_one_instance_per_episode_from_the_rows_columns(env_file):
    e = envs(env_file, "Counter")
    assert [env.turns for env in e.envs] == [2, 1]
    assert e.reset() == [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]]
    first = e.step([0, 1], ["a", "b"], turn=1)
    assert [(r.observation, r.reward, r.done) for r in first] == [
        ([{"role": "user", "content": "you said a"}], 0.5, False),
        (None, 0.5, True),
    ]
    second = e.step([0], ["c"], turn=2)
    assert (second[0].observation, second[0].done) == (None, True)


def test_async_step_and_chat_messages(env_file):
    e = envs(env_file, "AsyncCounter")
    assert [r.done for r in e.step([0, 1], ["a", "b"], turn=1)] == [False, True]
    m = envs(env_file, "Messages")
    assert m.reset()[0][0] == {"role": "system", "content": "be brief"}
    assert m.step([0], ["a"], turn=1)[0].observation == [{"role": "tool", "content": "42"}]


@pytest.mark.parametrize(
    "name, turn, message",
    [
        ("Broken", 2, "step() raised ValueError: boom"),
        ("WrongType", 1, "step() must return (observation, reward, done), got tuple"),
        ("NanReward", 1, "step()'s reward must be finite, got nan"),
        ("NotDone", 1, "step() returned no observation (None) but done=False"),
    ],
)
def test_a_failing_environment_is_one_line_naming_it_the_row_and_the_turn(env_file, name, turn, message):
    e = envs(env_file, name)
    with pytest.raises(EnvironmentError) as info:
        for t in range(1, 3):
            e.step([0], ["a"], turn=t)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"environment `{env_file}:{name}`, prompt row 7, turn {turn}: ")
    assert message in text


def test_a_missing_column_and_a_bad_path_are_one_line(env_file):
    with pytest.raises(EnvironmentError, match=r"prompt row 7, reset: building it raised TypeError"):
        envs(env_file, "Counter", rows=({"prompt": "hi"},))
    with pytest.raises(EnvironmentError, match=r"environment `.*:Nope`: .* has no attribute `Nope`"):
        load_environment(f"{env_file}:Nope")
