"""A small multi-turn game for the built-in recipe (`environment.path: guess_number`)."""

from __future__ import annotations

import re
from typing import Any, Optional


class GuessNumber:
    """Higher/lower: the model guesses a whole number in [low, high] (the row's `secret`); each wrong guess is
    answered "Higher." or "Lower.", a turn without a number in range "Answer with one number from LOW to HIGH.".
    The right guess ends the episode with reward 1.0; every other turn gives 0.0 (an episode not won within
    `environment.max_turns` turns is truncated). The opening is the row's prompt."""

    def __init__(self, secret: int, prompt: str = "", low: int = 1, high: int = 8, **columns: Any):
        self.secret, self.low, self.high = int(secret), int(low), int(high)
        self.prompt = prompt or (
            f"I am thinking of a whole number from {self.low} to {self.high}. Guess it: answer with the number only."
        )

    def reset(self) -> str:
        return self.prompt

    def step(self, action: str) -> tuple[Optional[str], float, bool]:
        numbers = [int(n) for n in re.findall(r"-?\d+", action)]
        guess = numbers[0] if numbers else None
        if guess is None or not self.low <= guess <= self.high:
            return f"Answer with one number from {self.low} to {self.high}.", 0.0, False
        if guess == self.secret:
            return None, 1.0, True
        return ("Higher." if guess < self.secret else "Lower."), 0.0, False
