"""TextArena's single-player games as lmppo environments: `environment.path: textarena:ENV_ID`.

    game = TextArenaGame(env_id, game_seed=..., **row columns)   one game per episode, seeded from the row
    game.reset() -> the game's opening (its prompt and board)
    game.step(text) -> (what the game said since, 0.0, False) while it runs; (None, reward at close, True) at its end

TextArena's LLM wrappers repeat the whole game in every observation; the adapter reads the messages the game adds
at each step from the unwrapped game instead (its action wrappers still apply, e.g. `5` sent as `[5]`), and leaves
out the echo of the model's own move, so the episode gets only what is new. An invalid move is the game's message
("You attempted an invalid move ..."), as TextArena makes it; the game ends it after its allowance. The reward is the
player's entry of `env.close()` when the game ends (TextArena's; GuessTheNumber: 1 for a win, else how close the
last guess was), on the episode's last turn.

Games draw from Python's (and some from numpy's) global random generator: each game keeps its own generator state,
seeded from its seed at reset and swapped in around each call, so a game never moves the run's generators and the
same seed is the same game whatever else ran in between (exact resume, held-out games that stay the same).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import io
import json
import numbers
import os
import random
import sys
from typing import Iterator, Mapping, Optional, Protocol

import numpy as np

from lmppo.errors import LmppoError
from lmppo.models.extras import environments_library

TEXTARENA = "textarena:"
"""`environment.path: textarena:ENV_ID`."""
LIST_GAMES = "python -m lmppo.environments.textarena_games"
"""Prints the ids that run with one player here (tries each: about a minute)."""
PLAYER = 0


class ArenaGame(Protocol):
    """What the adapter uses of a TextArena environment (`textarena.make(id)`, wrapped or not)."""

    def reset(self, num_players: int, seed: Optional[int] = None) -> object: ...

    def step(self, action: str) -> tuple[bool, object]: ...

    def get_observation(self) -> tuple[int, list[tuple[int, str, object]]]: ...

    def close(self) -> tuple[Optional[Mapping[int, float]], object]: ...


class TextArenaGame:
    """One single-player TextArena game (module docstring). `game_seed`: the row's seed for the game
    (`data.prompts: builtin:textarena` makes rows that carry one); a row without it is seeded from a hash of its
    prompt and columns, so the same row is always the same game."""

    def __init__(self, env_id: str, game_seed: Optional[int] = None, prompt: str = "", **columns: object):
        self.env_id = env_id
        self.seed = int(game_seed) if game_seed is not None else row_seed(prompt, columns)
        self.game: ArenaGame = _make(env_id)
        self.inner: ArenaGame = _unwrapped(self.game)
        self.generators: Optional[tuple[object, object]] = None

    def reset(self) -> str:
        with self._own_random(fresh=True):
            self.game.reset(num_players=1, seed=self.seed)
            return self._new_text()

    def step(self, action: str) -> tuple[Optional[str], float, bool]:
        with self._own_random():
            done, _info = self.game.step(action)
            if not done:
                return self._new_text(), 0.0, False
            rewards, game_info = self.game.close()
        return None, final_reward(self.env_id, rewards, game_info), True

    def _new_text(self) -> str:
        """The messages the game added since the last call, the model's own move left out."""
        _player, messages = self.inner.get_observation()
        texts = [text.strip() for sender, text, _kind in messages if sender != PLAYER]
        return "\n".join(t for t in texts if t) or "(no message)"

    @contextlib.contextmanager
    def _own_random(self, fresh: bool = False) -> Iterator[None]:
        """Python's and numpy's global generators set to this game's state for the call, the caller's put back."""
        outer = (random.getstate(), np.random.get_state())
        if fresh:
            random.seed(self.seed)
            np.random.seed(self.seed)
        elif self.generators is not None:
            random.setstate(self.generators[0])  # type: ignore[arg-type]
            np.random.set_state(self.generators[1])  # type: ignore[arg-type]
        try:
            yield
        finally:
            self.generators = (random.getstate(), np.random.get_state())
            random.setstate(outer[0])
            np.random.set_state(outer[1])


INVALID_MOVE = "Invalid Move: "
"""How TextArena's single-player state starts the reason of a game ended by an invalid move."""


def final_reward(env_id: str, rewards: Optional[Mapping[int, object]], game_info: object) -> float:
    """The player's reward at the end of a game. TextArena 0.7.4's single-player state is
    `set_invalid_move(reason, reward)`, and some games (ThreeCardMonte, Countdown, Crosswords, Cryptarithm, ...) call
    it as `(reward, reason)`: the game that ends on an invalid move then holds the message as the reward and the
    number in its reason ("Invalid Move: 0.0"). The number is read back from there; any other reward that is not a
    number is one error line naming the game and the value."""
    value = (rewards or {}).get(PLAYER, 0.0)
    if isinstance(value, numbers.Real):
        return float(value)
    info = game_info.get(PLAYER) if isinstance(game_info, Mapping) else None
    reason = str(info.get("reason", "")) if isinstance(info, Mapping) else ""
    if isinstance(value, str) and reason.startswith(INVALID_MOVE):
        try:
            return float(reason[len(INVALID_MOVE) :])
        except ValueError:
            pass
    raise LmppoError(
        f"environment `{TEXTARENA}{env_id}`: the game ended with reward {value!r} for the player (reason "
        f"{reason!r}); a reward must be a number"
    )


def row_seed(prompt: str, columns: Mapping[str, object]) -> int:
    """A game seed from a row without `game_seed`: 31 bits of sha256 of its prompt and columns."""
    text = json.dumps([prompt, dict(columns)], sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") >> 1


class GameFactory(Protocol):
    """`TextArenaGame` with its game id bound: built with a row's columns."""

    def __call__(self, game_seed: Optional[int] = None, prompt: str = "", **columns: object) -> TextArenaGame: ...


def textarena_factory(env_id: str) -> GameFactory:
    """The class of `environment.path: textarena:ENV_ID`, after one game of it was built and reset with one player
    (so an id that is not registered, needs two players or fails offline is one error line before any model loads)."""
    check_game(env_id)
    return functools.partial(TextArenaGame, env_id)


def check_game(env_id: str) -> None:
    """One error line unless `env_id` is in TextArena's registry and a game of it resets with one player here."""
    where = f"environment.path `{TEXTARENA}{env_id}`"
    registry: Mapping[str, object] = environments_library("textarena.envs.registration", where).ENV_REGISTRY
    if env_id not in registry:
        close = difflib.get_close_matches(env_id, list(registry), n=3, cutoff=0.5)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise LmppoError(
            f"{where}: `{env_id}` is not a TextArena game{hint}; the single-player ids that run here: {LIST_GAMES}"
        )
    try:
        _try_game(env_id)
    except Exception as err:  # noqa: BLE001 - TextArena's own assertion (two players) or a failed download
        why = " ".join(f"{type(err).__name__}: {err}".replace("*", " ").split())  # nltk frames its in asterisks
        raise LmppoError(
            f"{where}: a game of it did not start with one player here ({why[:200]}): it needs two or more "
            f"players, or a download; the single-player ids that run here: {LIST_GAMES}"
        ) from None


def single_player_ids() -> list[str]:
    """The registered ids whose games reset with one player here (each tried once)."""
    registry = environments_library("textarena.envs.registration", "listing TextArena games").ENV_REGISTRY
    ok = []
    for env_id in sorted(registry):
        try:
            _try_game(env_id)
        except Exception:  # noqa: BLE001, S112 - a game that does not start is not listed
            continue
        ok.append(env_id)
    return ok


def _try_game(env_id: str) -> None:
    """Build and reset one game of `env_id`, what TextArena and nltk print on the way swallowed (a failed download
    prints a dozen lines)."""
    with _quiet_descriptors(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        TextArenaGame(env_id, game_seed=0).reset()


@contextlib.contextmanager
def _quiet_descriptors() -> Iterator[None]:
    """File descriptors 1 and 2 point at /dev/null for the block: nltk's downloader writes to the `sys.stderr` it
    bound when it was imported, which `contextlib.redirect_stderr` does not reach."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as null:
        try:
            os.dup2(null.fileno(), 1)
            os.dup2(null.fileno(), 2)
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def _make(env_id: str) -> ArenaGame:
    ta = environments_library("textarena", f"environment.path `{TEXTARENA}{env_id}`")
    game: ArenaGame = ta.make(env_id)
    return game


def _unwrapped(game: ArenaGame) -> ArenaGame:
    """The game under its wrappers (TextArena's `Wrapper` keeps the wrapped one in `.env`)."""
    ta = environments_library("textarena", "TextArena games")
    inner: object = game
    while isinstance(inner, ta.Wrapper):
        inner = inner.env
    return inner  # type: ignore[return-value]


if __name__ == "__main__":
    print("\n".join(single_player_ids()))
