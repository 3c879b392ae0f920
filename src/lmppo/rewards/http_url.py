"""The URL of an HTTP reward source, checked before training: one ConfigError naming the field, never urllib's
``ValueError: Port out of range 0-65535`` after the models have loaded."""

from __future__ import annotations

import urllib.parse
from typing import TYPE_CHECKING

from lmppo.errors import ConfigError

if TYPE_CHECKING:
    from lmppo.config import RewardConfig


def check_http_url(url: str, field: str) -> urllib.parse.SplitResult:
    """The parts of `url`; ConfigError naming `field` for a scheme other than http/https, no host, a port that is
    not a number in 1-65535, or spaces and control characters (http.client would refuse them at the first request).
    Credentials in the URL are masked in the message (ConfigError's own masking)."""
    if not isinstance(url, str):
        raise ConfigError(field, url, "must be an http:// or https:// URL (a string)")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise ConfigError(field, url, "holds a space or control character; percent-encode it (%20)")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        scheme = f"scheme `{parts.scheme}`" if parts.scheme else "no scheme"
        raise ConfigError(field, url, f"has {scheme}; must be an http:// or https:// URL")
    if not parts.hostname:
        raise ConfigError(field, url, "names no host; write it as http://HOST[:PORT]/PATH")
    hostport = parts.netloc.rpartition("@")[2]
    rest = hostport.rpartition("]")[2] if hostport.startswith("[") else hostport  # [IPv6]:port
    port = rest.partition(":")[2]
    if port and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(field, url, f"has port `{port}`; a port is a number from 1 to 65535")
    return parts


def check_reward_urls(reward: "RewardConfig") -> None:
    """`check_http_url` on the URL of every `http` reward source, naming `reward.sources[i].path`."""
    for i, source in enumerate(reward.sources):
        if source.kind == "http":
            check_http_url(source.path, f"reward.sources[{i}].path")
