"""A small multi-turn game for the built-in recipe (`environment.path: guess_number`)."""

from __future__ import annotations

import re
from typing import Optional


class GuessNumber:
    """Higher/lower: the model guesses a whole number in [low, high] (the row's `secret`); each wrong guess is
    answered "Higher. Your next guess?" or "Lower. Your next guess?", a turn without a number in range "Reply with a
    single number from LOW to HIGH.".
    The right guess ends the episode with reward 1.0; every other turn gives 0.0 (an episode not won within
    `environment.max_turns` turns is truncated). The opening is the row's prompt."""

    def __init__(self, secret: int, prompt: str = "", low: int = 1, high: int = 8, **columns: object):
        self.secret, self.low, self.high = int(secret), int(low), int(high)
        self.prompt = prompt or (
            f"Let's play a game. I picked a secret number between {self.low} and {self.high}. What is your guess? "
            "Reply with a single number."
        )

    def reset(self) -> str:
        return self.prompt

    def step(self, action: str) -> tuple[Optional[str], float, bool]:
        numbers = [int(n) for n in re.findall(r"-?\d+", action)]
        guess = numbers[0] if numbers else None
        if guess is None or not self.low <= guess <= self.high:
            return f"Reply with a single number from {self.low} to {self.high}.", 0.0, False
        if guess == self.secret:
            return None, 1.0, True
        return ("Higher." if guess < self.secret else "Lower.") + " Your next guess?", 0.0, False
