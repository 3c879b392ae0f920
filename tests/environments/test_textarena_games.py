"""TextArena games through lmppo's contract, on the real library (GuessTheNumber-v0): only the new text of each
observation reaches the episode, an invalid move is an observation, the reward is the game's at close, and the
same row is the same game (different rows, different games)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy as np
import pytest

from lmppo.config import EnvironmentConfig
from lmppo.data.generated import TEXTARENA_GAMES, game_seed, generated_records
from lmppo.environments.api import EpisodeEnvironments, load_environment
from lmppo.environments.episodes import play_episodes
from lmppo.environments.render import observation_encoder
from lmppo.environments.textarena_games import LIST_GAMES, TextArenaGame, final_reward, row_seed
from lmppo.errors import LmppoError

pytest.importorskip("textarena")  # the extra `environments` (installed by `make setup`, so CI runs these)

GAME = "textarena:GuessTheNumber-v0"


def secret(seed: int) -> int:
    """The number a GuessTheNumber-v0 game seeded `seed` hides (read from a game of its own)."""
    game = TextArenaGame("GuessTheNumber-v0", game_seed=seed)
    game.reset()
    return int(game.inner.game_number)  # type: ignore[attr-defined]


class Scripted:
    """Plays fixed turn texts, each followed by the stop token (as tests/environments/test_environments_episodes)."""

    def __init__(self, tokenizer, stop, script):
        self.tokenizer, self.stop, self.script = tokenizer, stop, script

    def _turn(self, k, on):
        ids = lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.stop]  # noqa: E731
        return [ids(self.script[b][k]) if live else [] for b, live in enumerate(on)]

    def first(self, prompts, seeds):
        return self._turn(0, [True] * len(prompts))

    def next(self, observations, turn):
        return self._turn(turn, [o is not None for o in observations])


def play(tokenizer, script, seeds, max_turns=6):
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    factory = load_environment(GAME)
    columns = [{"prompt": "Play the game.", "game_seed": s} for s in seeds]
    envs = EpisodeEnvironments(factory, GAME, columns, list(range(len(seeds))))
    cfg = EnvironmentConfig(path=GAME, max_turns=max_turns, max_episode_tokens=2000, max_observation_tokens=400)
    encoder = observation_encoder(tokenizer, [stop], "chat")
    return play_episodes(
        envs, Scripted(tokenizer, stop, script), encoder, tokenizer, [[1]] * len(seeds), [0] * len(seeds), cfg, [stop]
    )


def test_an_episode_gets_only_what_is_new_and_the_reward_at_close(tokenizer):
    s = secret(11)
    wrong = 1 if s != 1 else 2
    hint = "higher" if s > wrong else "lower"
    (episode,) = play(tokenizer, [["I think it is seven.", f"[{wrong}]", str(s)]], [11])
    turn1, invalid, turn2, answer, turn3 = episode.transcript
    # the invalid move is the game's own message, the episode goes on
    assert invalid.startswith("You attempted an invalid move. Reason: Invalid move format.")
    # only the new message: not the opening again, not the echo of the model's move ("[Player] [1]")
    assert answer == f"The target number is {hint}."
    # the reward is the game's at close (1 for the win), on the last turn only; the game ended the episode
    assert episode.turn_rewards == [0.0, 0.0, 1.0] and episode.stop_reason == "environment"
    assert turn3 == str(s)  # sent as `[s]` by TextArena's action wrapper


def test_the_opening_is_the_games_prompt_and_textarenas_own_observation_repeats_it():
    import textarena

    game = TextArenaGame("GuessTheNumber-v0", game_seed=3)
    opening = game.reset()
    assert opening.startswith("You are Player 0. You are playing Guess The Number.")
    assert game.step("[1]")[0] in ("The target number is higher.", "Congratulations! You guessed the correct number.")
    # what the adapter saves the episode from: the wrapped game's observation holds the whole game each turn
    wrapped = textarena.make("GuessTheNumber-v0")
    wrapped.reset(num_players=1, seed=3)
    wrapped.get_observation()
    wrapped.step("[1]")
    _, repeated = wrapped.get_observation()
    assert "You are playing Guess The Number" in repeated and "[1]" in repeated


def test_a_lost_game_ends_with_textarenas_reward_for_it():
    s = secret(5)
    game = TextArenaGame("GuessTheNumber-v0", game_seed=5)
    game.reset()
    # two invalid moves in a row end a TextArena game (its error allowance is 1), with its reward for the loss
    assert game.step("no number")[2] is False
    observation, reward, done = game.step("still no number")
    assert done and observation is None
    assert reward == 0.0 and 1 <= s <= 20  # no valid guess yet: 0 of the way to the number


def test_a_game_that_swaps_reward_and_reason_on_an_invalid_move_ends_with_its_reward():
    # ThreeCardMonte-v0 calls TextArena's `set_invalid_move(reason, reward)` as (0.0, "Bad action. ..."): its reward
    # at close is the message; before the adapter read it back, float() of it stopped the run at the second bad move
    game = TextArenaGame("ThreeCardMonte-v0", game_seed=2)
    game.reset()
    assert game.step("the middle one")[2] is False
    observation, reward, done = game.step("still the middle one")
    assert done and observation is None and reward == 0.0
    assert isinstance(game.game.close()[0][0], str)  # the game's own record of it, as it stands in TextArena 0.7.4


def test_a_reward_that_is_not_a_number_nor_a_swapped_reason_is_one_line_naming_the_game():
    assert final_reward("Demo-v0", {0: 1}, {}) == 1.0 and final_reward("Demo-v0", None, None) == 0.0
    assert final_reward("Demo-v0", {0: "Bad action."}, {0: {"reason": "Invalid Move: 0.25"}}) == 0.25
    with pytest.raises(LmppoError, match=r"textarena:Demo-v0`: the game ended with reward 'won' .* must be a number"):
        final_reward("Demo-v0", {0: "won"}, {0: {"reason": "You won."}})


def test_the_same_row_is_the_same_game_and_other_rows_are_other_games():
    assert secret(7) == secret(7)
    assert len({secret(s) for s in range(8)}) > 2
    # a row without `game_seed` is seeded from its prompt and columns
    assert row_seed("a", {"x": 1}) == row_seed("a", {"x": 1}) != row_seed("b", {"x": 1})
    same = [TextArenaGame("GuessTheNumber-v0", prompt="guess 1", level=3) for _ in range(2)]
    assert same[0].seed == same[1].seed != TextArenaGame("GuessTheNumber-v0", prompt="guess 2", level=3).seed


def test_builtin_textarena_rows_carry_seeds_made_from_the_run_seed():
    rows = generated_records(TEXTARENA_GAMES, 4, 0, {})
    assert [r["game_seed"] for r in rows] == [game_seed(0, i) for i in range(4)]
    assert rows == generated_records(TEXTARENA_GAMES, 4, 0, {})
    assert generated_records(TEXTARENA_GAMES, 6, 0, {})[:4] == rows  # a row does not depend on the size
    assert {r["game_seed"] for r in rows}.isdisjoint(
        r["game_seed"] for r in generated_records(TEXTARENA_GAMES, 4, 1, {})
    )


def test_a_game_leaves_the_runs_random_generators_alone():
    random.seed(1)
    np.random.seed(1)
    expected = (random.random(), np.random.rand())
    random.seed(1)
    np.random.seed(1)
    game = TextArenaGame("GuessTheNumber-v0", game_seed=2)
    game.reset()
    game.step("[3]")
    assert (random.random(), np.random.rand()) == expected


@pytest.mark.parametrize(
    "env_id, words",
    [
        ("GuessTheNumbr-v0", ["`GuessTheNumbr-v0` is not a TextArena game", "did you mean GuessTheNumber-v0"]),
        ("TicTacToe-v0", ["did not start with one player", "The number of players has to be 2"]),
    ],
)
def test_an_id_that_cannot_run_here_is_one_line_naming_it_and_the_listing(env_id, words):
    with pytest.raises(LmppoError) as err:
        load_environment(f"textarena:{env_id}")
    text = str(err.value)
    assert "\n" not in text and f"textarena:{env_id}" in text and LIST_GAMES in text
    for word in words:
        assert word in text


def test_a_game_that_needs_a_download_is_one_clean_line_from_the_command_line(tmp_path):
    """Hangman-v0 needs nltk's `words`, which nltk tries to download (no network here): its dozen `[nltk_data]`
    lines go to the stderr nltk bound at import, past Python's redirection, so a real process shows what users see."""
    run = subprocess.run(
        [sys.executable, "-m", "lmppo.apps.cli", "train", "--environment.path", "textarena:Hangman-v0",
         "--output_dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=240, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert run.returncode == 2 and run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: environment.path `textarena:Hangman-v0`"), run.stderr
    assert "LookupError" in lines[0] and LIST_GAMES in lines[0] and not (tmp_path / "run").exists()
