"""A small environment for the episode tests (loaded by path: `tests/countdown_env.py:Countdown`)."""


class Countdown:
    """Ends after `turns` turns; each turn earns 0.25 plus `per_word` per word of the action; the observation names
    the turn."""

    def __init__(self, turns, prompt="", per_word=0.0):
        self.turns, self.seen, self.prompt, self.per_word = int(turns), 0, prompt, float(per_word)

    def reset(self):
        return self.prompt

    def step(self, action):
        self.seen += 1
        done = self.seen >= self.turns
        reward = 0.25 + self.per_word * len(action.split())
        return (None if done else f"turn {self.seen} done, go on"), reward, done


class BreaksLater(Countdown):
    """Countdown whose step raises once `BREAK_AT` environments have been built in this process (the first
    iterations of a run go well, a later one fails)."""

    built = 0
    BREAK_AT = 10**9

    def __init__(self, turns, prompt="", per_word=0.0):
        super().__init__(turns, prompt, per_word)
        type(self).built += 1
        self.broken = type(self).built > type(self).BREAK_AT

    def step(self, action):
        if self.broken:
            raise RuntimeError("the environment's server went away")
        return super().step(action)


class FailsOnSome(Countdown):
    """Countdown whose step raises at turn `fail_at` of its row (0: never), the same rows at every run."""

    def __init__(self, turns, prompt="", per_word=0.0, fail_at=0):
        super().__init__(turns, prompt, per_word)
        self.fail_at = int(fail_at)

    def step(self, action):
        if self.seen + 1 == self.fail_at:
            raise RuntimeError(f"failed at turn {self.fail_at}")
        return super().step(action)


class DropsThrees(Countdown):
    """Countdown whose rows of 3 turns fail at their 2nd turn (for `environment.on_error: drop`)."""

    def step(self, action):
        if self.turns == 3 and self.seen == 1:
            raise RuntimeError("a row of three")
        return super().step(action)
