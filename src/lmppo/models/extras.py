"""The libraries of lmppo's extra `environments` (TextArena games, reasoning-gym tasks), imported only when a run
uses them: lmppo imports and runs without them."""

from __future__ import annotations

import importlib
from types import ModuleType

from lmppo.errors import LmppoError

ENVIRONMENTS_EXTRA = 'pip install "lmppo[environments]"'
"""How to install both libraries (pyproject.toml's extra `environments`)."""

_DISTRIBUTIONS = {"textarena": "textarena", "reasoning_gym": "reasoning-gym"}


def environments_library(module: str, wanted_by: str) -> ModuleType:
    """The module `textarena` or `reasoning_gym` (or one of theirs: `reasoning_gym.utils`), or one error line
    naming the extra that installs it; `wanted_by` says what needs it (`environment.path textarena:...`)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = _DISTRIBUTIONS.get(module.split(".")[0], module)
        raise LmppoError(
            f"{wanted_by} needs the package `{package}`, which is not installed: {ENVIRONMENTS_EXTRA}"
        ) from None
