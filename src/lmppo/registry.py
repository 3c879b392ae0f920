"""Extension points: one registry idiom for every named, pluggable implementation.

A `Registry` maps a name (what a config field holds) to an implementation. Built-ins are declared by a
`module:attribute` target, so the names can be listed (config validation, `--help`) without importing the
modules (and torch); the target is imported on first `get`. Three ways in, one rule (a name is taken once):

- a built-in: one `module:attribute` line in the declarations at the end of this module (the implementation may
  also carry the registry's decorator, which then only confirms the declaration);
- Python code: `REGISTRY.register("name")(obj)` (also usable as a decorator) before the config is built;
- an installed plug-in: an entry point in the registry's group (e.g. `lmppo.sampling_engines`), found on demand.

Config validation and `lmppo train --help` read the allowed values of each option from here.

Traits: what a variant needs from the rest of the run (an advantage estimator's groups of responses, a KL
estimator's full logits, a controller's timing), declared with it where it is registered, so no caller tests a
name. A registry names its traits and their defaults; a built-in declares its own with `builtin(target, **traits)`,
code with `register(name, **traits)`, and a plug-in (or an object registered without them) as attributes of the
implementation of the same names. `trait(name, key)` reads them in that order.
"""

from __future__ import annotations

import difflib
import functools
import importlib
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Generic, Iterator, Mapping, TypeVar

from lmppo.errors import ConfigError, LmppoError

T = TypeVar("T")
_MISSING = object()


@functools.lru_cache(maxsize=None)
def _entry_points() -> metadata.EntryPoints:
    """Every installed entry point, read once for all registries (reading them is the slow part of `--help`)."""
    return metadata.entry_points()


class DuplicateNameError(LmppoError, ValueError):
    """A name registered twice."""


@dataclass(frozen=True)
class Builtin:
    """A built-in's declaration: its `module:attribute` target and its traits (`builtin(...)`)."""

    target: str
    traits: Mapping[str, object] = field(default_factory=dict)


def builtin(target: str, **traits: object) -> Builtin:
    """A built-in at `target` (`module:attribute`) with `traits` (names the registry declares)."""
    return Builtin(target, traits)


class Registry(Generic[T]):
    """Named implementations of one extension point.

    `what`: what an entry is ("sampling engine"); `option`: the config field that names one ("rollout.backend");
    `builtins`: name -> `module:attribute` (or `builtin(target, **traits)`); `group`: the entry-point group of
    installed plug-ins; `traits`: the traits an entry may declare -> the value of one that does not; `also`: the
    forms the option takes besides a name (`module:Class`), shown by `--help`."""

    def __init__(
        self,
        what: str,
        option: str,
        builtins: Mapping[str, str | Builtin],
        group: str = "",
        traits: Mapping[str, object] | None = None,
        also: tuple[str, ...] = (),
    ) -> None:
        self.what, self.option, self.group, self.also = what, option, group, also
        self.trait_defaults: dict[str, object] = dict(traits or {})
        declared = {name: b if isinstance(b, Builtin) else Builtin(b) for name, b in builtins.items()}
        self._targets: dict[str, str] = {name: b.target for name, b in declared.items()}
        self._traits: dict[str, dict[str, object]] = {
            name: self._checked_traits(name, b.traits) for name, b in declared.items()
        }
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

    def register(self, name: str, **traits: object) -> Callable[[T], T]:
        """Add `obj` under `name` (as `register(name)(obj)` or as a decorator) with its `traits`; a name already
        taken is an error (a built-in's own module confirming its declaration is not)."""
        checked = self._checked_traits(name, traits)

        def add(obj: T) -> T:
            declared = self._targets.get(name) == f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', '')}"
            if name in self.names() and not (declared and name not in self._loaded):
                raise DuplicateNameError(f"{self.what} `{name}` is already registered; choose another name")
            self._loaded[name] = obj
            if checked or not declared:
                self._traits[name] = checked
            return obj

        return add

    def trait(self, name: str, key: str) -> Any:
        """The trait `key` of `name`: as declared with it, else the implementation's attribute `key` (a plug-in's
        way; imports it), else the registry's default. ConfigError (naming the option) for an unknown `name`."""
        if key not in self.trait_defaults:
            raise KeyError(f"{self.what} has no trait `{key}` (it declares {sorted(self.trait_defaults)})")
        declared = self._traits.get(name, {})
        if key in declared:
            return declared[key]
        self.check(name)
        if name in self._traits and name in self._builtins:  # a built-in without it: the default, no import
            return self.trait_defaults[key]
        return getattr(self.get(name), key, self.trait_defaults[key])

    def with_trait(self, key: str, value: object = True) -> tuple[str, ...]:
        """The registered names whose trait `key` is `value` (imports the plug-ins that declare it as an attribute)."""
        return tuple(name for name in self.names() if self.trait(name, key) == value)

    def _checked_traits(self, name: str, traits: Mapping[str, object]) -> dict[str, object]:
        unknown = sorted(set(traits) - set(self.trait_defaults))
        if unknown:
            raise TypeError(
                f"{self.what} `{name}`: unknown trait(s) {unknown}; {self.what}s declare {sorted(self.trait_defaults)}"
            )
        return dict(traits)

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
        self._traits.pop(name, None)

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
        "pi": builtin(
            "lmppo.core.kl_control:PIKLController",
            react="now",
            gains=("coef", "kp", "ki", "kd", "coef_min", "coef_max"),
        ),
        "adaptive": builtin("lmppo.core.kl_control:AdaptiveKLController", gains=("horizon",)),
        "fixed": "lmppo.core.kl_control:FixedKLController",
    },
    group="lmppo.kl_controllers",
    traits={"react": "next", "gains": ()},
)
"""Trait `react`: the `kl.react` that `auto` means for this controller: `now` (beta answers a batch's KL before
that batch's rewards) or `next` (after its update, from the next batch on: Ziegler's and TRL's timing).
Trait `gains`: the `kl.*` fields the controller reads as its gains, which config validation then holds to their
bounds (`lmppo.config.validation.KL_GAIN_BOUNDS`: `pi` takes the log of `coef`, `adaptive` divides by `horizon`)."""
KL_ESTIMATORS: Registry[Any] = Registry(
    "KL estimator",
    "kl.estimator",
    {
        "k1": "lmppo.core.kl:kl_k1",
        "k2": "lmppo.core.kl:kl_k2",
        "k3": "lmppo.core.kl:kl_k3",
        "exact": builtin("lmppo.core.kl:exact_kl", full_logits=True),
    },
    group="lmppo.kl_estimators",
    traits={"full_logits": False},
)
"""Trait `full_logits`: False: `fn(logprobs, ref_logprobs)` (B, T) of the sampled tokens, a per-token estimate;
True: `fn(logits, ref_logits)` (..., V) -> (...), the divergence of each next-token distribution over the whole
vocabulary, a function of the state, not of the sampled token (the rollout then keeps the reference's logits)."""
ADVANTAGE_ESTIMATORS: Registry[Any] = Registry(
    "advantage estimator",
    "ppo.advantage_estimator",
    {
        "gae": "lmppo.core.advantages:gae",
        "turn_gae": "lmppo.core.advantages:turn_gae",
        "rloo": builtin("lmppo.core.advantages:rloo", needs_groups=True, uses_values=False),
        "grpo": builtin("lmppo.core.advantages:grpo", needs_groups=True, uses_values=False, group_scale=True),
        "reinforce_pp": builtin("lmppo.core.advantages:reinforce_pp", uses_values=False),
    },
    group="lmppo.advantage_estimators",
    traits={"needs_groups": False, "uses_values": True, "group_scale": False},
)
"""Trait `needs_groups`: the estimator compares the responses to one prompt (`group_ids`), so it needs
rollout.num_samples_per_prompt >= 2. Trait `uses_values`: its advantages read the value function; without it no
value function is trained (`ppo.vf_coef` counts as 0: a shared head's value loss would move the policy's trunk for
nothing). Trait `group_scale`: the estimator divides group-centred scores by a scale it takes as `scale` (a name of
`lmppo.core.advantages.GROUP_SCALES`, `ppo.grpo_scale`) and `batch_std` (the spread of the whole batch)."""
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
        "function": "lmppo.rewards.functions:FunctionSource",
        "http": "lmppo.rewards.http:HttpSource",
    },
    group="lmppo.reward_sources",
)
ENVIRONMENTS: Registry[Any] = Registry(
    "environment",
    "environment.path",
    {
        "tools": "lmppo.environments.tools:ToolEnvironment",
        "guess_number": "lmppo.environments.games:GuessNumber",
    },
    group="lmppo.environments",
    also=("module:Class", "file.py:Class", "textarena:ENV_ID"),
)
"""Built-in environments; `environment.path` also takes `module:Class` or `path/to/file.py:Class`."""

EXTENSION_POINTS = (
    SAMPLING_ENGINES,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    ADVANTAGE_ESTIMATORS,
    TRACKERS,
    REWARD_SOURCES,
    ENVIRONMENTS,
)
"""Every registry, for `--help` (`option` names the config field each one fills)."""
