"""A Config from a YAML file plus dotted overrides, written back as YAML; the recipes shipped in the package."""

from __future__ import annotations

import os
from importlib import resources
from typing import Mapping, TypeVar

from lmppo.config.fields import from_dict
from lmppo.config.overrides import apply_override
from lmppo.config.schema import Config
from lmppo.config.yaml_input import YamlInputError
from lmppo.config.yaml_input import load as load_yaml
from lmppo.errors import ConfigError

C = TypeVar("C")


def load_config(path: str | None = None, overrides: Mapping[str, object] | None = None) -> Config:
    """Config from an optional YAML file plus dotted overrides; not yet validated."""
    return load_root(Config, path, overrides)


def load_root(root: type[C], path: str | None = None, overrides: Mapping[str, object] | None = None) -> C:
    """Root config class `root` (`Config`, `RewardModelConfig`) from an optional YAML file plus dotted overrides."""
    import yaml

    data: object = {}
    if path:
        path = config_file(path)
        if not os.path.isfile(path):
            raise ConfigError("config file", path, "no such file")
        try:
            with open(path, encoding="utf-8") as fh:
                data = load_yaml(fh) or {}  # no duplicate keys, bounded alias expansion (lmppo.config.yaml_input)
        except YamlInputError as err:
            raise ConfigError("config file", path, str(err)) from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(
                "config file", path, f"is not valid YAML{where}: {getattr(err, 'problem', None) or err}"
            ) from None
        except UnicodeDecodeError as err:
            raise ConfigError("config file", path, f"is not UTF-8 text ({err.reason})") from None
        if not isinstance(data, dict):
            raise ConfigError("config file", path, "must hold a mapping of fields at the top level")
    cfg = from_dict(root, data)
    for dotted, raw in (overrides or {}).items():
        apply_override(cfg, dotted, raw)
    return cfg


def save_config(cfg: Config, path: str) -> None:
    import yaml

    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(cfg.to_dict(), fh, sort_keys=False)


def recipe_path(name: str) -> str:
    """A recipe shipped inside the package (`lmppo/recipes/NAME.yaml`)."""
    return str(resources.files("lmppo") / "recipes" / f"{name}.yaml")


def recipe_names() -> list[str]:
    """The recipes shipped inside the package, by name."""
    folder = resources.files("lmppo") / "recipes"
    return sorted(f.name[: -len(".yaml")] for f in folder.iterdir() if f.name.endswith(".yaml"))


def recipe_choices() -> str:
    """The packaged recipes as a CONFIG argument names them, for help and error lines."""
    return ", ".join(f"builtin:{n}" for n in recipe_names())


def config_file(path: str) -> str:
    """The YAML file a CONFIG argument names: a path, or `builtin:NAME` for a recipe shipped in the package (so an
    installed lmppo runs them without a checkout: `lmppo train builtin:arithmetic`)."""
    if not path.startswith("builtin:"):
        return path
    name = path[len("builtin:") :]
    if name not in recipe_names():
        raise ConfigError("config file", path, "the built-in recipes are " + recipe_choices())
    return recipe_path(name)
