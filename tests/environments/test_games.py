"""The higher/lower game of the built-in recipe."""

from lmppo.environments.games import GuessNumber


def test_higher_lower_and_the_win():
    game = GuessNumber(secret=5, low=1, high=8)
    assert "between 1 and 8" in game.reset()
    assert game.step("3") == ("Higher. Your next guess?", 0.0, False)
    assert game.step("My guess is 7") == ("Lower. Your next guess?", 0.0, False)
    assert game.step("nine") == ("Reply with a single number from 1 to 8.", 0.0, False)
    assert game.step("12") == ("Reply with a single number from 1 to 8.", 0.0, False)
    assert game.step("5") == (None, 1.0, True)
    assert GuessNumber(secret="2", prompt="Guess!").reset() == "Guess!"
