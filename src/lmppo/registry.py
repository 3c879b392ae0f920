"""Extension points: one registry idiom for every named, pluggable implementation.

A `Registry` maps a name (what a config field holds) to an implementation. Built-ins are declared by a
`module:attribute` target, so the names can be listed (config validation, `--help`) without importing the
modules (and torch); the target is imported on first `get`. Three ways in, one rule (a name is taken once):

- a built-in: one `module:attribute` line in `lmppo.extensions`;
- Python code: `REGISTRY.register("name")(obj)` (also usable as a decorator) before the config is built;
- an installed plug-in: an entry point in the registry's group (e.g. `lmppo.sampling_engines`), found on demand.
"""

from __future__ import annotations

import difflib
import importlib
from importlib import metadata
from typing import Callable, Generic, TypeVar

from lmppo.errors import ConfigError, LmppoError

T = TypeVar("T")


class Registry(Generic[T]):
    """Named implementations of one extension point.

    `what`: what an entry is ("sampling engine"); `option`: the config field that names one ("rollout.backend");
    `builtins`: name -> `module:attribute`; `group`: the entry-point group of installed plug-ins."""

    def __init__(self, what: str, option: str, builtins: dict[str, str], group: str = "") -> None:
        self.what, self.option, self.group = what, option, group
        self._targets: dict[str, str] = dict(builtins)
        self._loaded: dict[str, T] = {}
        self._plugins_scanned = not group

    def names(self) -> tuple[str, ...]:
        """Every registered name: built-ins first, in declaration order, then the rest."""
        self._scan_plugins()
        return tuple(dict.fromkeys([*self._targets, *self._loaded]))

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def register(self, name: str) -> Callable[[T], T]:
        """Add `obj` under `name` (as `register(name)(obj)` or as a decorator); a name already taken is an error."""

        def add(obj: T) -> T:
            if name in self.names():
                raise LmppoError(f"{self.what} `{name}` is already registered; choose another name")
            self._loaded[name] = obj
            return obj

        return add

    def get(self, name: str) -> T:
        """The implementation called `name`, imported on first use; ConfigError naming the option otherwise."""
        if name not in self._loaded:
            self.check(name)
            module, _, attribute = self._targets[name].partition(":")
            self._loaded[name] = getattr(importlib.import_module(module), attribute)
        return self._loaded[name]

    def check(self, name: str) -> str:
        """`name` if registered, else one ConfigError naming the option, the value and the allowed names."""
        allowed = self.names()
        if name not in allowed:
            hint = difflib.get_close_matches(str(name), allowed, n=1)
            raise ConfigError(
                self.option,
                name,
                "must be one of "
                + ", ".join(f"`{a}`" for a in allowed)
                + (f" (did you mean `{hint[0]}`?)" if hint else ""),
            )
        return name

    def _scan_plugins(self) -> None:
        if self._plugins_scanned:
            return
        self._plugins_scanned = True
        for entry in metadata.entry_points(group=self.group):
            if entry.name in self._targets or entry.name in self._loaded:
                raise LmppoError(
                    f"{self.what} `{entry.name}` from the installed plug-in `{entry.value}` (entry point group "
                    f"{self.group}) is already registered; uninstall one of them"
                )
            self._targets[entry.name] = entry.value
