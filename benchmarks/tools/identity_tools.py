"""A tool for refactor_identity.py's `env_tools` configuration (`environment.tools`)."""


def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a * b
