"""What the config's sections are made of, read back: field types and docstrings, and pydantic's errors in lmppo's
words (one ConfigError naming the dotted field)."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import sys
import typing
from functools import lru_cache
from typing import Sequence, TypeVar

from pydantic import ValidationError

from lmppo.errors import ConfigError


def type_hints(cls: type) -> dict[str, object]:
    """The resolved annotations of `cls` (read once per class)."""
    return _type_hints(cls)


@lru_cache(maxsize=None)
def _type_hints(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls)


@lru_cache(maxsize=None)
def _module_field_docs(module: str) -> dict[str, dict[str, str]]:
    """{class name: {field: docstring}} for every class of `module`, from one parse of its source."""
    tree = ast.parse(inspect.getsource(sys.modules[module]))
    out: dict[str, dict[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            docs = out.setdefault(node.name, {})
            for stmt, nxt in zip(node.body, node.body[1:]):
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    doc = nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) else None
                    if isinstance(doc, str):
                        docs[stmt.target.id] = " ".join(doc.split())
    return out


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass, read from the source (written once)."""
    return _module_field_docs(cls.__module__).get(cls.__name__, {})


_ALLOWED = {
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "registered_name": "{message}",
}
"""pydantic's error types in lmppo's words."""


def config_error(err: ValidationError, cls: type, prefix: str) -> ConfigError:
    """The first error of a pydantic validation of section `cls` (from a mapping, or one assignment) as one
    ConfigError naming the dotted field (`prefix`: where `cls` sits in the config, e.g. `ppo.`)."""
    first = err.errors(include_url=False)[0]
    loc, kind, value = first["loc"], first["type"], first.get("input")
    key = len(loc) - 1 if kind == "invalid_key" else -1  # a mapping's key that is not a string: not an index
    name = prefix + "".join(f"[{p}]" if isinstance(p, int) and i != key else f".{p}" for i, p in enumerate(loc)).lstrip(
        "."
    )
    name = name.replace(".[", "[").rstrip(".") or "config"
    if kind in ("unexpected_keyword_argument", "no_such_attribute", "invalid_key"):
        parent = type_at(cls, loc[:-1])
        names = [f.name for f in dataclasses.fields(parent)] if dataclasses.is_dataclass(parent) else []
        hint = difflib.get_close_matches(str(loc[-1]) if loc else "", names, n=1)
        where = name.rsplit(".", 1)[0] + "." if "." in name else ""
        return ConfigError(
            name, value, "is not a known field" + (f" (did you mean `{where}{hint[0]}`?)" if hint else "")
        )
    if kind in ("dataclass_type", "dataclass_args_type", "dataclass_exact_type"):
        section_cls = type_at(cls, loc)
        what = getattr(section_cls, "__name__", first.get("ctx", {}).get("class_name", "config"))
        return ConfigError(name, value, f"must be a mapping of {what} fields")
    if kind == "literal_error":
        allowed = typing.get_args(type_at(cls, loc))
        hint = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        return ConfigError(
            name,
            value,
            "must be one of "
            + ", ".join(f"`{a}`" for a in allowed)
            + (f" (did you mean `{hint[0]}`?)" if hint else ""),
        )
    if kind == "list_type" and isinstance(value, str):
        return ConfigError(name, value, f"must be a list, e.g. [{value!r}]")
    message = first["msg"]
    bounds = {k: f"{v:g}" if isinstance(v, float) else v for k, v in first.get("ctx", {}).items()}
    return ConfigError(
        name, value, _ALLOWED[kind].format(**bounds) if kind in _ALLOWED else message[:1].lower() + message[1:]
    )


def type_at(cls: object, loc: Sequence[int | str]) -> object:
    """The declared type at `loc` (field names and list indices) inside section `cls`; None where it is not one."""
    tp = cls
    for part in loc:
        if isinstance(part, str) and isinstance(tp, type) and dataclasses.is_dataclass(tp) and part in type_hints(tp):
            tp = type_hints(tp)[part]
        elif isinstance(part, int) and typing.get_origin(tp) is list:
            tp = typing.get_args(tp)[0]
        else:
            return None
    return tp


@lru_cache(maxsize=None)
def section_prefixes(root: type) -> dict[type, str]:
    """Where each section class sits in `root` (`reward.sources[*].` for the items of a list)."""
    out: dict[type, str] = {root: ""}

    def walk(cls: type, prefix: str) -> None:
        for name, tp in type_hints(cls).items():
            if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
                out[typing.get_args(tp)[0]] = f"{prefix}{name}[*]."
            elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
                out[tp] = f"{prefix}{name}."
                walk(tp, f"{prefix}{name}.")

    walk(root, "")
    return out


T = TypeVar("T")


def from_dict(cls: type[T], data: object, prefix: str = "") -> T:
    """Section `cls` built from a nested mapping (converted and checked by pydantic); one ConfigError naming the
    first bad field, with a did-you-mean for unknown ones."""
    try:
        # pydantic adds __pydantic_validator__ when it decorates the class: not on `type[T]`
        return cls.__pydantic_validator__.validate_python({} if data is None else data)  # type: ignore[attr-defined]
    except ValidationError as err:
        raise config_error(err, cls, prefix + "." if prefix else "") from None
