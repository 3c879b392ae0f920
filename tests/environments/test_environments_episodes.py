"""The episode loop with a scripted sampler: turns, observations, rewards, the three endings, and an observation
over its budget as one error line."""

from __future__ import annotations

import pytest

from lmppo.config import EnvironmentConfig
from lmppo.environments.api import EnvironmentError, EpisodeEnvironments
from lmppo.environments.episodes import play_episodes
from lmppo.environments.games import GuessNumber
from lmppo.environments.render import observation_encoder


class Scripted:
    """Plays fixed turn texts (each encoded, then the stop token), recording what it was given."""

    def __init__(self, tokenizer, stop, script):
        self.tokenizer, self.stop, self.script, self.given = tokenizer, stop, script, []

    def _turn(self, k, rows):
        return [
            self.tokenizer(self.script[b][k], add_special_tokens=False)["input_ids"] + [self.stop] if on else []
            for b, on in enumerate(rows)
        ]

    def first(self, prompts, seeds):
        self.given.append(list(prompts))
        return self._turn(0, [True] * len(prompts))

    def next(self, observations, turn):
        self.given.append(list(observations))
        return self._turn(turn, [o is not None for o in observations])


def play(tokenizer, script, secrets, **cfg):
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    envs = EpisodeEnvironments(GuessNumber, "guess_number", [{"secret": s} for s in secrets], list(range(len(secrets))))
    sampler = Scripted(tokenizer, stop, script)
    encoder = observation_encoder(tokenizer, [stop], "chat")
    episodes = play_episodes(
        envs, sampler, encoder, tokenizer, [[1]] * len(secrets), [0] * len(secrets), EnvironmentConfig(**cfg), [stop]
    )
    return episodes, sampler


def test_guessing_episodes_turn_by_turn(tokenizer):
    episodes, sampler = play(tokenizer, [["4", "6", "5"], ["2", "9", "3"], ["8", "7", "1"]], [5, 2, 3], max_turns=3)
    won, first_try, lost = episodes
    assert won.transcript == ["4", "Higher. Your next guess?", "6", "Lower. Your next guess?", "5"]
    assert won.turn_rewards == [0.0, 0.0, 1.0]
    assert won.stop_reason == "environment"
    assert first_try.transcript == ["2"] and first_try.turn_rewards == [1.0]
    assert lost.stop_reason == "max_turns" and lost.turn_rewards == [0.0, 0.0, 0.0] and len(lost.turn_ends) == 3
    # the turns' spans, and the observation between them, in the episode's tokens
    start, end = won.turn_starts[1], won.turn_ends[1]
    assert tokenizer.decode(won.tokens[start : end + 1]) == "6<|im_end|>"
    between = won.tokens[won.turn_ends[0] + 1 : won.turn_starts[1]]
    assert (
        tokenizer.decode(between) == "\n<|im_start|>user\nHigher. Your next guess?<|im_end|>\n<|im_start|>assistant\n"
    )
    # the sampler got the ended episode's None, and only new tokens for the others
    assert sampler.given[1][1] is None and sampler.given[1][0] == between


def test_the_episode_budget_ends_an_episode_truncated(tokenizer):
    episodes, _ = play(tokenizer, [["4", "6", "5"]], [5], max_turns=3, max_episode_tokens=20)
    (episode,) = episodes
    assert episode.stop_reason == "max_episode_tokens" and len(episode.tokens) <= 20
    assert len(episode.turn_ends) == 1  # the observation after turn 1 left no room for a second turn


def test_an_observation_over_its_budget_is_one_error_line(tokenizer):
    expected = r"environment `guess_number`, prompt row 0, turn 1: the observation is \d+ tokens, over environment"
    with pytest.raises(EnvironmentError, match=expected + r"\.max_observation_tokens \(5\)"):
        play(tokenizer, [["4", "6"]], [5], max_observation_tokens=5)
