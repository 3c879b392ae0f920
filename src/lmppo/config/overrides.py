"""Dotted options (`--ppo.num_epochs 2`, YAML `ppo: {num_epochs: 2}`): every leaf field listed with its type, default
and documentation, and set from a command-line string."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Sequence

from lmppo.config.fields import field_docs, section_prefixes, type_hints
from lmppo.config.schema import Config
from lmppo.config.validation import FLOAT_RANGES
from lmppo.config.yaml_input import YamlInputError
from lmppo.config.yaml_input import load as load_yaml
from lmppo.errors import ConfigError
from lmppo.registry import EXTENSION_POINTS

REGISTRY_OPTIONS = {r.option.replace("[*]", ""): r for r in EXTENSION_POINTS}
"""The options whose allowed values a registry holds, by dotted name (list items without the index)."""


def all_fields(cls: type = Config, prefix: str = "") -> list[tuple[str, object, object, str]]:
    """Every leaf option as (dotted name, type, default, doc), for `--help` and dotted overrides."""
    out = []
    hints, docs = type_hints(cls), field_docs(cls)
    default = cls()
    for f in dataclasses.fields(cls):
        tp, name = hints[f.name], prefix + f.name
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out += all_fields(tp, name + ".")
        else:
            doc = docs.get(f.name, "")
            allowed = [
                f"{sign} {getattr(m, bound)}"
                for m in cls.__pydantic_fields__[f.name].metadata  # type: ignore[attr-defined]  # set by pydantic
                for bound, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
                if hasattr(m, bound)
            ]
            if name in FLOAT_RANGES and cls in section_prefixes(Config):  # ranges `Config.validate` checks
                allowed.append(f"[{FLOAT_RANGES[name][0]:g}, {FLOAT_RANGES[name][1]:g}]")
            if name in REGISTRY_OPTIONS:
                others = REGISTRY_OPTIONS[name].also
                allowed.append(
                    "one of "
                    + ", ".join(_choices(cls, f.name, name))
                    + (f", or {' or '.join(others)}" if others else "")
                )
            if allowed:
                doc += " Allowed: " + ", ".join(allowed) + "."
            out.append((name, tp, getattr(default, f.name), doc))
    return out


def registered_choices(dotted: str, root: type = Config) -> tuple[str, ...]:
    """The values of an option a registry checks: the registry's names and the extras its field also takes
    (`kl.estimator`: the estimators and `exact`). List items are named without the index (`reward.sources.kind`)."""
    cls: object = root
    *parents, leaf = dotted.split(".")
    for part in parents:
        cls = type_hints(cls)[part]  # type: ignore[arg-type]
        if typing.get_origin(cls) is list:
            cls = typing.get_args(cls)[0]
    return _choices(cls, leaf, dotted)


def _choices(section: object, leaf: str, dotted: str) -> tuple[str, ...]:
    """The values field `leaf` of `section` (at `dotted`) takes from its registry."""
    for meta in section.__pydantic_fields__[leaf].metadata:  # type: ignore[attr-defined]  # set by pydantic
        names = getattr(getattr(meta, "func", None), "allowed_names", None)
        if names is not None:
            return tuple(names())
    return tuple(REGISTRY_OPTIONS[dotted].names())


class UnknownOption(ConfigError):
    """A command-line option that is no field of the config: named, with the closest one."""

    def __init__(self, option: str, known: Sequence[str], command: str = "lmppo train"):
        close = difflib.get_close_matches(option.lstrip("-"), known, n=1)
        hint = f" (did you mean `--{close[0]}`?)" if close else ""
        self.field, self.value, self.allowed = option, None, "is not a known option" + hint
        Exception.__init__(self, f"unknown option `{option}`{hint}; see `{command} --help`")


def apply_override(cfg: object, dotted: str, raw: object) -> None:
    """Set `cfg.<dotted>` from a command-line string (or YAML value); the assignment converts and checks it.
    Command-line syntax: a list is `a,b` or YAML `[a, b]`, a mapping or a section YAML `{k: v}`."""
    *parents, leaf = dotted.split(".")
    obj: object = cfg
    for part in [*parents, leaf]:
        if not dataclasses.is_dataclass(obj) or part not in type_hints(type(obj)):
            options = [n for n, *_ in all_fields(type(cfg))]
            hint = difflib.get_close_matches(dotted, options, n=1)
            extra = f" (did you mean `--{hint[0]}`?)" if hint else ""
            raise ConfigError(dotted, raw, "is not a known option" + extra)
        if part != leaf:
            obj = getattr(obj, part)
    tp = type_hints(type(obj))[leaf]
    if isinstance(raw, str) and (typing.get_origin(tp) in (list, dict) or dataclasses.is_dataclass(tp)):
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if typing.get_origin(tp) is list and not dataclasses.is_dataclass(item) and not raw.strip().startswith("["):
            raw = [v for v in raw.split(",") if v]
        else:
            raw = _yaml_value(raw, dotted)
            raw = {} if raw is None and typing.get_origin(tp) is dict else raw
    setattr(obj, leaf, raw)


def _yaml_value(raw: str, name: str) -> object:
    """A YAML value given on the command line (a list or mapping), or ConfigError naming the option."""
    import yaml

    try:
        return load_yaml(raw)  # no duplicate keys, bounded alias expansion (lmppo.config.yaml_input)
    except yaml.YAMLError as err:
        raise ConfigError(name, raw, f"is not valid YAML: {getattr(err, 'problem', None) or err}") from None
    except YamlInputError as err:
        raise ConfigError(name, raw, f"is refused: {err}") from None


def parse_overrides(args: Sequence[str], root: type = Config, command: str = "lmppo train") -> dict[str, str]:
    """`--a.b value` / `--a.b=value` pairs -> {"a.b": "value"} for the fields of config class `root` (the config of
    `command`); unknown options get a did-you-mean."""
    leaves = [n for n, *_ in all_fields(root)]
    known = leaves + [n.rsplit(".", 1)[0] for n in leaves if "." in n]
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError("command line", arg, "unexpected argument; options look like --section.field VALUE")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if key not in known:
            raise UnknownOption(f"--{key}", known, command)
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"--{key}", None, "needs a value")
            value = args[i + 1]
            i += 1
        out[key] = value
        i += 1
    return out
