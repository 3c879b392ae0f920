"""`lmppo train --help`, generated from the schema: every field with its type, default (as YAML would write it),
documentation and allowed values, the fields of list items (reward sources) included, with which kind each applies to.
Imports no torch, so the help answers at once."""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from typing import Literal

from lmppo.config.fields import field_docs, type_hints
from lmppo.config.loading import recipe_choices
from lmppo.config.overrides import REGISTRY_OPTIONS, all_fields, registered_choices
from lmppo.config.reward_model import RewardModelConfig
from lmppo.config.schema import Config

WIDTH = 100
KIND_ONLY = {"HTTP only:": "http", "Model sources:": "model"}
"""A list item's field whose docstring starts so applies only to that kind (the docstring says it once)."""


def show(value: object) -> str:
    """A default as a user would write it in YAML: `true`, `""`, `[a, b]`, `{k: v}`, never a Python repr."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return (
            value if value and value.strip() == value and not value.startswith(("[", "{", "*", "&")) else f'"{value}"'
        )
    if isinstance(value, float):
        return f"{value:g}"
    if dataclasses.is_dataclass(value):
        return show({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return str(value)


def type_name(tp: object, name: str = "") -> str:
    """`{a,b,c}` for a choice (a Literal or a registry's names), `LIST[...]` for a list, else the type's name."""
    if typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        return "LIST[" + ("SECTION" if dataclasses.is_dataclass(item) else type_name(item, name)) + "]"
    if name in REGISTRY_OPTIONS:  # the names, then any other form it takes (`{tools,guess_number}|module:Class`)
        return "|".join(["{" + ",".join(registered_choices(name)) + "}", *REGISTRY_OPTIONS[name].also])
    if typing.get_origin(tp) is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(tp)) + "}"
    if typing.get_origin(tp) is dict:
        return "MAPPING"
    return (getattr(tp, "__name__", None) or str(tp).replace("typing.", "")).upper()


def _entry(lines: list[str], flag: str, tp: object, name: str, default: object, doc: str, indent: int) -> None:
    pad = " " * indent
    lines.append(f"{pad}{flag} {type_name(tp, name)}   (default: {show(default)})")
    lines += textwrap.wrap(doc, WIDTH, initial_indent=pad + "    ", subsequent_indent=pad + "    ")


def item_help(name: str, cls: type, example: str) -> list[str]:
    """The fields of one item of list option `name` (a section class), which kinds each applies to."""
    lines = [f"      each item, a mapping ({example}):"]
    docs, hints, default = field_docs(cls), type_hints(cls), cls()
    kinds: dict[str, list[str]] = {}
    for key, tp, value, doc in all_fields(cls, f"{name}."):
        field = key.rsplit(".", 1)[1]
        only = next((k for prefix, k in KIND_ONLY.items() if docs.get(field, "").startswith(prefix)), None)
        for kind in REGISTRY_OPTIONS[f"{name}.kind"].names() if "kind" in hints else []:
            if field != "kind" and only in (None, kind):
                kinds.setdefault(kind, []).append(field)
        _entry(lines, field, tp, key, getattr(default, field, value), doc, 8)
    if kinds:
        lines.append("        fields by kind: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in kinds.items()))
    return lines


def train_help() -> str:
    lines = [
        "usage: lmppo train [CONFIG.yaml | builtin:RECIPE] [--section.field VALUE ...] [--resume OUTPUT_DIR] [--debug]",
        "",
        "Train a causal LM with PPO. With no CONFIG the built-in default recipe runs (lmppo/recipes/",
        "sentiment.yaml; the defaults below are those of an empty config). CONFIG is a YAML file or a recipe",
        "shipped in the package: " + recipe_choices() + ".",
        "Any option below overrides the config file (lists: comma-separated or YAML `[a, b]`; mappings: YAML",
        "`{k: v}`).",
        "",
        "  --resume OUTPUT_DIR   continue the run in OUTPUT_DIR from its latest complete checkpoint",
        "  --accept-changed-inputs  with --resume: go on although the prompt data or a model folder differs from",
        "                        what the run began with (refused otherwise, naming it)",
        "  --debug               show tracebacks for errors",
    ]
    return "\n".join(lines + options_help(Config))


def reward_model_help() -> str:
    """`lmppo reward-model --help`: the options of `lmppo.config.reward_model.RewardModelConfig`."""
    lines = [
        "usage: lmppo reward-model [CONFIG.yaml] [--section.field VALUE ...] [--resume OUTPUT_DIR] [--debug]",
        "",
        "Train a reward model on preference pairs (TRL's format: `chosen`, `rejected`, optional `prompt` and",
        "`margin`; text or chat) with the Bradley-Terry loss; held-out pair accuracy and margin before, after each",
        "epoch and at the end. With no option: the built-in pairs of positive over negative movie-review",
        "sentences, whole and as continuations of the default recipe's prompts, on SmolLM2-135M with LoRA",
        "(docs/stages.md). The result, OUTPUT_DIR/final/reward-model, is what `reward.sources: [{kind: model,",
        "path: OUTPUT_DIR/final/reward-model}]` takes; the default folder is the one `lmppo train",
        "builtin:learned_reward` reads. Options are spelled as `lmppo train`'s (a YAML file, dotted overrides).",
        "",
        "  --resume OUTPUT_DIR   continue the run in OUTPUT_DIR from its latest complete checkpoint",
        "  --debug               show tracebacks for errors",
    ]
    return "\n".join(lines + options_help(RewardModelConfig))


def options_help(root: type) -> list[str]:
    """The `options:` part of a command's help: every field of root config class `root`, section by section."""
    lines = ["", "options:"]
    section = None
    for name, tp, default, doc in all_fields(root):
        head = name.split(".")[0] if "." in name else ""
        if head != section:
            section = head
            lines += ["", f" [{head or 'run'}]"]
        _entry(lines, f"--{name}", tp, name, default, doc, 2)
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if isinstance(item, type) and dataclasses.is_dataclass(item):
            example = f"--{name} '[{{kind: http, path: \"http://HOST/score\", weight: 0.5}}]'"
            lines += item_help(name, item, f"YAML list in the config file, or {example}")
    return lines
