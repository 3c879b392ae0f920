"""The config section machinery: a section is a pydantic dataclass whose construction and assignments raise one
``ConfigError`` naming the field with its dotted place in the root config (`lmppo.config.schema.Config`)."""

from __future__ import annotations

from dataclasses import field
from functools import wraps
from typing import TypeVar, cast

import pydantic
from pydantic import ValidationError
from typing_extensions import dataclass_transform

from lmppo.config.fields import config_error, section_prefixes

_ROOTS: list[type] = []  # the root config classes (`lmppo train`'s, `lmppo reward-model`'s), set by `set_root`


def set_root(root: type) -> None:
    """A class whose fields place its sections (error messages name `rollout.batch_size`, not `batch_size`). A
    section shared by two roots sits at the same place in both."""
    _ROOTS.append(root)


def _prefix(cls: type) -> str:
    return next((section_prefixes(r)[cls] for r in _ROOTS if cls in section_prefixes(r)), "")


_SETTINGS = pydantic.ConfigDict(
    validate_assignment=True, extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False
)
"""pydantic's lax conversion ("2" -> 2, "false" -> False, 2.0 -> 2, 3 -> "3") on construction and on every
assignment; unknown fields, non-finite floats and values of another type are refused."""


@pydantic.dataclasses.dataclass(config=_SETTINGS)
class _Section:
    @pydantic.model_validator(mode="before")
    @classmethod
    def _empty_is_default(cls, data: object) -> object:
        return {} if data is None else data  # `ppo:` with nothing under it in YAML


S = TypeVar("S")


@dataclass_transform(field_specifiers=(field, pydantic.Field))
def section(cls: type[S]) -> type[S]:
    """A config section: a pydantic dataclass whose construction and assignments raise one ConfigError."""
    made = cast("type[S]", pydantic.dataclasses.dataclass(cls, config=_SETTINGS))
    init, assign = made.__init__, made.__setattr__

    @wraps(init)
    def __init__(self: object, *args: object, **kwargs: object) -> None:
        try:
            init(self, *args, **kwargs)
        except ValidationError as err:
            raise config_error(err, made, _prefix(made)) from None

    @wraps(assign)
    def __setattr__(self: object, name: str, value: object) -> None:
        try:
            assign(self, name, value)
        except ValidationError as err:
            raise config_error(err, made, _prefix(made)) from None

    setattr(made, "__init__", __init__)
    setattr(made, "__setattr__", __setattr__)
    return made
