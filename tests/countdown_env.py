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
