"""Values taken from the environment: `${VAR}` in HTTP reward headers (secrets, never stored expanded) and
`$VAR` / `${VAR}` in path fields (expanded once, when the config is validated)."""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Mapping
from typing import Protocol

from lmppo.errors import ConfigError
from lmppo.redact import ENV_REFERENCE


class HTTPSource(Protocol):
    """What `http_headers` reads of a reward source (`lmppo.config.schema.RewardSourceConfig`): a Protocol, so this
    module stays below the schema that uses it."""

    @property
    def path(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, str]: ...


_PATH_REFERENCE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def expand_path(value: str, name: str) -> str:
    """Path field `name` with `~`, `$VAR` and `${VAR}` expanded; ConfigError naming the variable when one is not
    set (the shell's expansion would silently give an empty string)."""

    def variable(match: re.Match) -> str:
        var = match.group(1) or match.group(2)
        if var not in os.environ:
            raise ConfigError(name, value, f"needs environment variable `{var}`, which is not set")
        return os.environ[var]

    return os.path.expanduser(_PATH_REFERENCE.sub(variable, value))


_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
RESERVED_HEADERS = ("host", "content-length", "content-type", "transfer-encoding", "connection")
"""Headers the HTTP reward source writes itself."""


def expand_env(template: str, name: str) -> tuple[str, list[str]]:
    """`template` with every `${VAR}` replaced by environment variable VAR, and the values put in (secrets, to be
    masked wherever a message could show them). ConfigError naming field `name` and the variable when one is
    not set or empty."""
    values: list[str] = []

    def value(match: re.Match) -> str:
        var = match.group(1)
        got = os.environ.get(var)
        if not got:
            raise ConfigError(
                name, template, f"needs environment variable `{var}`, which is " + ("empty" if got == "" else "not set")
            )
        values.append(got)
        return got

    return ENV_REFERENCE.sub(value, template), values


def http_headers(source: HTTPSource, where: str) -> tuple[dict[str, str], list[str]]:
    """The headers of an HTTP source with `${VAR}` expanded, and the values taken from the environment; one
    ConfigError for a bad name, a reserved header, a value that is not text, or a missing variable."""
    out: dict[str, str] = {}
    secrets: list[str] = []
    for key, template in source.headers.items():
        name = f"{where}.headers.{key}"
        if not isinstance(key, str) or not _HEADER_NAME.match(key):
            raise ConfigError(f"{where}.headers", key, "is not a valid HTTP header name (letters, digits, `-`)")
        if key.lower() in RESERVED_HEADERS:
            raise ConfigError(name, template, "is set by lmppo itself; remove it")
        if key.lower() == "authorization" and urllib.parse.urlsplit(source.path).username is not None:
            raise ConfigError(
                name, template, "conflicts with the credentials in the URL (sent as basic auth); give one or the other"
            )
        if not isinstance(template, str):
            raise ConfigError(name, template, "must be a string")
        value, used = expand_env(template, name)
        if any((ord(c) < 32 and c != "\t") or ord(c) == 127 for c in value):
            raise ConfigError(
                name,
                template,
                "holds a line break or control character"
                + (" (from " + ", ".join(f"`{m}`" for m in ENV_REFERENCE.findall(template)) + ")" if used else ""),
            )
        try:
            value.encode("latin-1")
        except UnicodeEncodeError:
            raise ConfigError(name, template, "holds characters an HTTP header cannot carry (only Latin-1)") from None
        out[key] = value
        secrets += used
    return out, secrets
