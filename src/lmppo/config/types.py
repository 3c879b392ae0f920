"""Field types of the config beyond pydantic's own: a fraction, a seed, and a name a registry holds."""

from __future__ import annotations

import difflib
from typing import Annotated

import pydantic
from pydantic_core import PydanticCustomError

from lmppo.registry import Registry

Fraction = Annotated[float, pydantic.Field(ge=0, le=1)]
"""A float within [0, 1]."""


def _not_a_bool(value: object) -> object:
    if isinstance(value, bool):  # pydantic's lax mode reads `true` as 1: a seed is a number, not a switch
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


def registered(registry: Registry, *extra: str) -> pydantic.AfterValidator:
    """The check of a `str` field whose value must be a name in `registry` (or one of `extra`), like a Literal's:
    `Annotated[str, registered(REGISTRY)]`."""

    def check(value: str) -> str:
        allowed = (*registry.names(), *extra)
        if value not in allowed:
            hint = difflib.get_close_matches(value, allowed, n=1)
            message = "must be one of " + ", ".join(f"`{a}`" for a in allowed)
            raise PydanticCustomError(
                "registered_name", "{message}", {"message": message + (f" (did you mean `{hint[0]}`?)" if hint else "")}
            )
        return value

    check.allowed_names = lambda: (*registry.names(), *extra)  # type: ignore[attr-defined]  # read by --help
    return pydantic.AfterValidator(check)


Seed = Annotated[int, pydantic.BeforeValidator(_not_a_bool), pydantic.Field(ge=0, le=2**32 - 1)]
"""What numpy and torch seed from: an integer in [0, 2**32 - 1] (`true` is refused, not read as 1)."""
