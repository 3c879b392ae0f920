"""Extension points: one registry idiom for every named, pluggable implementation.

A `Registry` maps a name (what a config field holds) to an implementation. Built-ins are declared by a
`module:attribute` target, so the names can be listed (config validation, `--help`) without importing the
modules (and torch); the target is imported on first `get`. Three ways in, one rule (a name is taken once):

- a built-in: one `module:attribute` line in the declarations at the end of this module (the implementation may
  also carry the registry's decorator, which then only confirms the declaration);
- Python code: `REGISTRY.register("name")(obj)` (also usable as a decorator) before the config is built;
- an installed plug-in: an entry point in the registry's group (e.g. `lmppo.sampling_engines`), found on demand.

Config validation and `lmppo train --help` read the allowed values of each option from here.
"""

from __future__ import annotations

import difflib
import functools
import importlib
from importlib import metadata
from typing import Any, Callable, Generic, Iterator, TypeVar

from lmppo.errors import ConfigError, LmppoError

T = TypeVar("T")
_MISSING = object()


@functools.lru_cache(maxsize=None)
def _entry_points() -> metadata.EntryPoints:
    """Every installed entry point, read once for all registries (reading them is the slow part of `--help`)."""
    return metadata.entry_points()


class DuplicateNameError(LmppoError, ValueError):
    """A name registered twice."""


class Registry(Generic[T]):
    """Named implementations of one extension point.

    `what`: what an entry is ("sampling engine"); `option`: the config field that names one ("rollout.backend");
    `builtins`: name -> `module:attribute`; `group`: the entry-point group of installed plug-ins."""

    def __init__(self, what: str, option: str, builtins: dict[str, str], group: str = "") -> None:
        self.what, self.option, self.group = what, option, group
        self._targets: dict[str, str] = dict(builtins)
        self._builtins = tuple(builtins)
        self._loaded: dict[str, T] = {}
        self._plugins_scanned = not group

    def names(self) -> tuple[str, ...]:
        """Every registered name: built-ins first, in declaration order, then the rest."""
        self._scan_plugins()
        return tuple(dict.fromkeys([*self._targets, *self._loaded]))

    def builtins(self) -> tuple[str, ...]:
        """The names declared by a `module:attribute` target (not plug-ins or code registrations)."""
        return tuple(self._builtins)

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def register(self, name: str) -> Callable[[T], T]:
        """Add `obj` under `name` (as `register(name)(obj)` or as a decorator); a name already taken is an error."""

        def add(obj: T) -> T:
            declared = self._targets.get(name) == f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', '')}"
            if name in self.names() and not (declared and name not in self._loaded):
                raise DuplicateNameError(f"{self.what} `{name}` is already registered; choose another name")
            self._loaded[name] = obj
            return obj

        return add

    def get(self, name: str, default: Any = _MISSING) -> T:
        """The implementation called `name`, imported on first use; `default` (if given) or ConfigError naming the
        option otherwise."""
        if default is not _MISSING and name not in self.names():
            return default
        if name not in self._loaded:
            self.check(name)
            module, _, attribute = self._targets[name].partition(":")
            obj = functools.reduce(getattr, attribute.split("."), importlib.import_module(module))
            self._loaded.setdefault(name, obj)  # importing the module may have registered it already
        return self._loaded[name]

    def check(self, name: str, field: str = "") -> str:
        """`name` if registered, else one ConfigError naming the option (`field`: e.g. with a list index), the value
        and the allowed names."""
        allowed = self.names()
        if name not in allowed:
            hint = difflib.get_close_matches(str(name), allowed, n=1)
            raise ConfigError(
                field or self.option,
                name,
                "must be one of "
                + ", ".join(f"`{a}`" for a in allowed)
                + (f" (did you mean `{hint[0]}`?)" if hint else ""),
            )
        return name

    # mapping-style access, as the dicts these registries replaced
    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __setitem__(self, name: str, obj: T) -> None:
        """Replace or add `name` without the duplicate check (tests that stand in an implementation)."""
        self._loaded[name] = obj

    def __delitem__(self, name: str) -> None:
        """Remove an entry added by code (not a built-in declaration)."""
        del self._loaded[name]
        self._targets.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def _scan_plugins(self) -> None:
        if self._plugins_scanned:
            return
        self._plugins_scanned = True
        for entry in _entry_points().select(group=self.group):
            if entry.name in self._targets or entry.name in self._loaded:
                raise LmppoError(
                    f"{self.what} `{entry.name}` from the installed plug-in `{entry.value}` (entry point group "
                    f"{self.group}) is already registered; uninstall one of them"
                )
            self._targets[entry.name] = entry.value


# ----------------------------------------------------------------------------- the extension points

SAMPLING_ENGINES: Registry[Any] = Registry(
    "sampling engine",
    "rollout.backend",
    {
        "native": "lmppo.sampling.engines:NativeEngine",
        "hf": "lmppo.sampling.engines:HFEngine",
        "vllm": "lmppo.sampling.engines:VLLMEngine",
    },
    group="lmppo.sampling_engines",
)
KL_CONTROLLERS: Registry[Any] = Registry(
    "KL controller",
    "kl.controller",
    {
        "pi": "lmppo.core.kl_control:PIKLController",
        "adaptive": "lmppo.core.kl_control:AdaptiveKLController",
        "fixed": "lmppo.core.kl_control:FixedKLController",
    },
    group="lmppo.kl_controllers",
)
KL_ESTIMATORS: Registry[Any] = Registry(
    "KL estimator",
    "kl.estimator",
    {"k1": "lmppo.core.kl:kl_k1", "k2": "lmppo.core.kl:kl_k2", "k3": "lmppo.core.kl:kl_k3"},
    group="lmppo.kl_estimators",
)
"""Per-token estimators from the sampled token's logprobs; `kl.estimator` also takes `exact` (KL_EXACT)."""
KL_EXACT = "exact"
"""The `kl.estimator` that is not an estimator: the KL over the whole vocabulary (`lmppo.core.kl.exact_kl`)."""
ADVANTAGE_ESTIMATORS: Registry[Any] = Registry(
    "advantage estimator",
    "ppo.advantage_estimator",
    {
        "gae": "lmppo.core.advantages:gae",
        "rloo": "lmppo.core.advantages:rloo",
        "grpo": "lmppo.core.advantages:grpo",
        "reinforce_pp": "lmppo.core.advantages:reinforce_pp",
    },
    group="lmppo.advantage_estimators",
)
GROUP_ADVANTAGE_ESTIMATORS = ("rloo", "grpo")
"""Estimators that compare the responses to one prompt (need rollout.num_samples_per_prompt >= 2)."""
TRACKERS: Registry[Any] = Registry(
    "tracker",
    "log.trackers",
    {
        name: f"lmppo.training.metrics:{cls}"
        for name, cls in (
            ("tensorboard", "TensorBoardTracker"),
            ("wandb", "WandbTracker"),
            ("trackio", "TrackioTracker"),
            ("aim", "AimTracker"),
            ("comet_ml", "CometMLTracker"),
            ("mlflow", "MLflowTracker"),
            ("clearml", "ClearMLTracker"),
            ("dvclive", "DVCLiveTracker"),
            ("swanlab", "SwanLabTracker"),
        )
    },
    group="lmppo.trackers",
)
"""Each built-in tracker needs the Python package of its own name (checked before any model loads)."""
REWARD_SOURCES: Registry[Any] = Registry(
    "reward source kind",
    "reward.sources[*].kind",
    {
        "model": "lmppo.rewards.model:ModelSource",
        "function": "lmppo.rewards.sources:FunctionSource",
        "http": "lmppo.rewards.http:HttpSource",
    },
    group="lmppo.reward_sources",
)

EXTENSION_POINTS = (SAMPLING_ENGINES, KL_CONTROLLERS, KL_ESTIMATORS, ADVANTAGE_ESTIMATORS, TRACKERS, REWARD_SOURCES)
"""Every registry, for `--help` (`option` names the config field each one fills)."""
