"""A run's `config.yaml`: the config with secrets masked, under a header that marks it as lmppo's own."""

from __future__ import annotations

import copy
import dataclasses
from typing import Sequence

import lmppo.run.storage as storage
from lmppo.config import Config, RewardModelConfig
from lmppo.config.fields import section_prefixes
from lmppo.redact import _SECRET_KEY, MASK, is_env_template, redact_text

CONFIG_HEADER_START = "# lmppo run config (secrets masked); resume with: "
CONFIG_HEADER = CONFIG_HEADER_START + "lmppo train --resume OUTPUT_DIR\n"
"""The first line of a run's config.yaml (a TRL drop-in run says there how to resume it instead)."""


def is_run_config(path: str) -> bool:
    """Whether `path` is a config.yaml that lmppo wrote (its first line is lmppo's header, whatever way to resume
    it names)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.readline().startswith(CONFIG_HEADER_START)
    except OSError:
        return False


def _config_field_names() -> frozenset[str]:
    """The field names of every section of the config tree (`environment.max_episode_tokens` is a field, not a
    secret), wherever the section's class is defined."""
    names: set[str] = set()
    for section in [*section_prefixes(Config), *section_prefixes(RewardModelConfig)]:
        names.update(f.name for f in dataclasses.fields(section))
    return frozenset(names)


def _redact(value: object, known: frozenset[str]) -> object:
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, (list, tuple)):
        return [_redact(v, known) for v in value]
    if isinstance(value, dict):
        return _redact_mapping(value, known)
    return value


def _redact_mapping(value: dict[str, object], known: frozenset[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in value.items():
        secret_key = isinstance(k, str) and k not in known and _SECRET_KEY.search(k)
        env_only = isinstance(v, str) and is_env_template(v)  # `Bearer ${TOKEN}`: no secret in the text
        out[k] = MASK if secret_key and v not in (None, "", False) and not env_only else _redact(v, known)
    return out


def redacted_config_dict(cfg: Config | RewardModelConfig | dict[str, object]) -> dict[str, object]:
    """The config as a plain dict, safe to write to files and trackers: credentials in URLs and strings masked
    (see `redact_text`), and values under secret-looking keys of free-form mappings (e.g. a `token` in
    rollout.generation_kwargs) replaced by `***`. Config fields themselves (`stop_token`, ...) are kept."""
    data = cfg if isinstance(cfg, dict) else cfg.to_dict()
    return _redact_mapping(copy.deepcopy(data), _config_field_names())


def masked_fields(data: object, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted name, value) of the string leaves of a config dict that hold a mask."""
    out: list[tuple[str, str]] = []
    if isinstance(data, dict):
        for k, v in data.items():
            out += masked_fields(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += masked_fields(v, f"{prefix}[{i}]")
    elif isinstance(data, str) and MASK in data:
        out.append((prefix, data))
    return out


def write_run_config(
    cfg: Config | RewardModelConfig, path: str, comments: Sequence[str] = (), resume_with: str = ""
) -> None:
    """`config.yaml` of a run (secrets masked), written atomically; `comments`: lines after the header (how a
    value was chosen, e.g. `precision: auto`); `resume_with`: how to resume it, when not `lmppo train --resume`."""
    import yaml

    header = CONFIG_HEADER.replace("lmppo train --resume OUTPUT_DIR", resume_with) if resume_with else CONFIG_HEADER
    text = header + "".join(f"# {' '.join(line.split())}\n" for line in comments)
    text += yaml.safe_dump(redacted_config_dict(cfg), sort_keys=False, allow_unicode=True)
    storage.write_text(path, text, "the run's config (config.yaml)")
