"""Config.validate: every check between fields and every name a registry holds, as named checks that each raise one
ConfigError naming the field, the value and what is allowed, before anything heavy is done. Bounds on one field
alone are in its type (`lmppo.config.schema`); what this machine can run is checked by the training layer."""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from typing import TYPE_CHECKING, Callable

from lmppo.config.env import expand_path, http_headers
from lmppo.config.fields import from_dict, type_hints
from lmppo.config.model_names import check_model_path, is_hub_repo_id
from lmppo.config.sampling_settings import check_generation_kwargs
from lmppo.errors import ConfigError
from lmppo.registry import ADVANTAGE_ESTIMATORS, ENVIRONMENTS, KL_CONTROLLERS, KL_ESTIMATORS

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from lmppo.config.schema import Config, KLConfig, RewardConfig


def validate_config(c: Config) -> None:
    """Every check, the sane float ranges last (the specific checks say more: `> 0`, ...)."""
    checked = from_dict(type(c), c.to_dict())  # lists and mappings changed in place are checked here
    for f in dataclasses.fields(c):
        if getattr(checked, f.name) != getattr(c, f.name):  # e.g. a mapping appended to reward.sources
            object.__setattr__(c, f.name, getattr(checked, f.name))
    for check in (
        check_run,
        check_models,
        check_data,
        check_rollout,
        lambda c: check_reward(c.reward, with_environment=bool(c.environment.path)),
        check_environment,
        check_kl,
        check_ppo,
        check_log,
    ):
        check(c)
    check_floats(c, "")


def check_run(c: Config) -> None:
    """output_dir (with `$VAR` expanded), deepspeed, push_to_hub, total_episodes."""
    if not c.output_dir.strip():
        raise ConfigError("output_dir", c.output_dir, "is empty; give the folder the run writes to, e.g. runs/my-run")
    c.output_dir = expand_path(c.output_dir, "output_dir")
    if c.deepspeed not in ("", "zero2", "zero3") and not os.path.isfile(c.deepspeed):
        raise ConfigError(
            "deepspeed", c.deepspeed, "must be `zero2`, `zero3`, a DeepSpeed JSON config file, or empty (off)"
        )
    if c.push_to_hub and not is_hub_repo_id(c.push_to_hub, bare=True):
        raise ConfigError("push_to_hub", c.push_to_hub, "must be a Hub model id, ORG/NAME (or empty: no upload)")
    if c.total_episodes < c.rollout.batch_size:
        raise ConfigError(
            "total_episodes",
            c.total_episodes,
            f"must be at least rollout.batch_size ({c.rollout.batch_size}) for one iteration",
        )


def check_models(c: Config) -> None:
    """The policy, tokenizer and critic paths; LoRA and 4-bit settings."""
    check_model_path(c.model.policy, "model.policy")
    if c.model.tokenizer:
        check_model_path(c.model.tokenizer, "model.tokenizer")
    if c.model.lora.enabled:
        _positive(c.model.lora.r, "model.lora.r")
        _in_range(c.model.lora.dropout, "model.lora.dropout", 0.0, 1.0, high_open=True)
    if c.model.load_in_4bit and not c.model.lora.enabled:
        raise ConfigError(
            "model.load_in_4bit",
            True,
            "trains LoRA adapters on frozen 4-bit weights: set model.lora.enabled = true",
        )
    if c.value.mode == "critic" and c.value.init_from not in ("auto", "reward_model", "policy"):
        check_model_path(c.value.init_from, "value.init_from")
    if c.value.mode == "critic" and c.value.init_from == "reward_model":
        if not any(s.kind == "model" for s in c.reward.sources):
            raise ConfigError(
                "value.init_from", "reward_model", "needs a reward source of kind `model`; use `policy` or `auto`"
            )


def check_data(c: Config) -> None:
    generated = c.data.prompts.startswith("builtin:") or c.data.prompts.startswith("reasoning_gym:")
    if not generated and not os.path.exists(c.data.prompts):
        raise ConfigError(
            "data.prompts",
            c.data.prompts,
            "no such file; give a .jsonl/.csv/.txt file, a "
            "dataset (save_to_disk folder, .parquet, .arrow) or `builtin:reviews` / `builtin:news` / "
            "`builtin:arithmetic` / `builtin:guess_number` / `builtin:textarena` / `reasoning_gym:TASK`",
        )


def check_rollout(c: Config) -> None:
    """The sampling engine, temperature, samples per prompt, generation settings and stop token."""
    r = c.rollout
    if not (r.temperature > 0):
        raise ConfigError("rollout.temperature", r.temperature, "must be > 0 (pure sampling at a temperature)")
    if r.batch_size % r.num_samples_per_prompt:
        raise ConfigError(
            "rollout.num_samples_per_prompt",
            r.num_samples_per_prompt,
            f"must divide rollout.batch_size ({r.batch_size})",
        )
    check_generation_kwargs(r.generation_kwargs, r.allow_distorting_sampling)  # the honest-KL refusal first
    if r.generation_kwargs and r.backend != "hf":
        raise ConfigError(
            "rollout.generation_kwargs",
            r.generation_kwargs,
            f"apply only to rollout.backend `hf` (this run uses `{r.backend}`, which always "
            "samples purely at the temperature)",
        )
    if not 0.0 < r.vllm_gpu_memory_utilization <= 1.0:
        raise ConfigError(
            "rollout.vllm_gpu_memory_utilization",
            r.vllm_gpu_memory_utilization,
            "must be in (0, 1]: the share of the GPU's memory the vLLM engine may use",
        )
    if r.backend == "vllm" and c.device == "cpu":
        raise ConfigError(
            "rollout.backend",
            r.backend,
            "needs a CUDA GPU, but this run has device `cpu`; use rollout.backend `native` or `hf`",
        )
    if r.backend == "vllm" and r.temperature < 0.01:
        raise ConfigError(
            "rollout.temperature",
            r.temperature,
            "must be >= 0.01 with rollout.backend `vllm`: "
            "vLLM raises lower temperatures to 0.01, so responses would not be sampled at the "
            "temperature their logprobs are measured at",
        )
    if r.stop_token == "none" and c.reward.truncation != "none":
        raise ConfigError(
            "reward.truncation",
            c.reward.truncation,
            "needs a stop token: with rollout.stop_token "
            "`none` every response is cut at max_new_tokens; use truncation `none`",
        )
    if not r.stop_token:
        raise ConfigError("rollout.stop_token", r.stop_token, "use `eos`, a token string, or `none`")
    if c.reward.overlong_buffer > r.max_new_tokens:
        raise ConfigError(
            "reward.overlong_buffer",
            c.reward.overlong_buffer,
            f"must be at most rollout.max_new_tokens ({r.max_new_tokens}): the penalty starts that many tokens "
            "before the longest response allowed",
        )
    if c.reward.overlong_buffer and c.environment.path:
        raise ConfigError(
            "reward.overlong_buffer",
            c.reward.overlong_buffer,
            "reads one response's length against rollout.max_new_tokens, and an environment's episodes have several "
            "turns (environment.path is set): use 0",
        )


def check_environment(c: Config) -> None:
    """The environment's name or import path, its tools, and what episodes cannot be combined with."""
    e = c.environment
    if not e.path:
        if e.tools:
            raise ConfigError("environment.tools", e.tools, "need an environment: set environment.path (e.g. `tools`)")
        return
    if e.path not in ENVIRONMENTS.builtins() and ":" not in e.path:
        raise ConfigError(
            "environment.path",
            e.path,
            f"must be a built-in environment ({', '.join(ENVIRONMENTS.builtins())}), `module:Class` or `file.py:Class`",
        )
    for i, tool in enumerate(e.tools):
        if ":" not in tool:
            raise ConfigError(f"environment.tools[{i}]", tool, "must look like `module:function` or `file.py:function`")
    if e.path == "tools" and not e.tools:
        raise ConfigError("environment.tools", e.tools, "is empty; environment `tools` needs at least one function")
    if KL_ESTIMATORS.trait(c.kl.estimator, "full_logits"):
        raise ConfigError(
            "kl.estimator",
            c.kl.estimator,
            "an estimator over the whole vocabulary is not available with an environment; use k1, k2 or k3",
        )
    if e.max_episode_tokens < c.rollout.max_new_tokens:
        raise ConfigError(
            "environment.max_episode_tokens",
            e.max_episode_tokens,
            f"must be at least rollout.max_new_tokens ({c.rollout.max_new_tokens}): one whole turn",
        )


def _coef_max_at_least_min(k: KLConfig) -> None:
    if not (k.coef_max >= k.coef_min):
        raise ConfigError("kl.coef_max", k.coef_max, f"must be >= kl.coef_min ({k.coef_min})")


KL_GAIN_BOUNDS: dict[str, Callable[[KLConfig], None]] = {
    "coef": lambda k: _positive(k.coef, "kl.coef"),
    "kp": lambda k: _non_negative(k.kp, "kl.kp"),
    "ki": lambda k: _non_negative(k.ki, "kl.ki"),
    "kd": lambda k: _non_negative(k.kd, "kl.kd"),
    "coef_min": lambda k: _positive(k.coef_min, "kl.coef_min"),
    "coef_max": _coef_max_at_least_min,
    "horizon": lambda k: _positive(k.horizon, "kl.horizon"),
}
"""The bound of each `kl.*` field a controller may read as a gain (its trait `gains`): a gain of a controller that
does not read it is free (`kl.coef` 0 is no KL term with `fixed`, but `pi` takes its log)."""


def check_kl(c: Config) -> None:
    """The estimator's placement; the gains the controller declares (`KL_CONTROLLERS` trait `gains`; names and
    kl.target's bounds are checked by their types)."""
    k = c.kl
    if k.placement == "both" and KL_ESTIMATORS.trait(k.estimator, "full_logits"):
        raise ConfigError(
            "kl.placement",
            k.placement,
            f"with kl.estimator `{k.estimator}` (over the whole vocabulary), use `reward` (the exact gradient "
            "of the response's KL, through the rewards and a loss term) or `loss` (the loss term only)",
        )
    if k.pull_without_signal and k.placement == "reward" and not KL_ESTIMATORS.trait(k.estimator, "full_logits"):
        raise ConfigError(
            "kl.pull_without_signal",
            True,
            f"needs a KL term in the loss to pull with: kl.placement `loss` or `both` (it is `{k.placement}`), "
            "or kl.estimator `exact`",
        )
    gains = tuple(KL_CONTROLLERS.trait(k.controller, "gains"))
    unknown = [g for g in gains if g not in KL_GAIN_BOUNDS]
    if unknown:
        raise ConfigError(
            "kl.controller",
            k.controller,
            f"declares the gains {unknown}, which are not kl fields with a bound (a controller's gains are among "
            f"{sorted(KL_GAIN_BOUNDS)})",
        )
    for gain in gains:
        KL_GAIN_BOUNDS[gain](k)


def check_ppo(c: Config) -> None:
    """Minibatch and micro-batch splits; the advantage estimator."""
    p, r = c.ppo, c.rollout
    if r.batch_size % p.num_minibatches:
        raise ConfigError("ppo.num_minibatches", p.num_minibatches, f"must divide rollout.batch_size ({r.batch_size})")
    if c.minibatch_size % p.micro_batch_size:
        raise ConfigError(
            "ppo.micro_batch_size",
            p.micro_batch_size,
            f"must divide the minibatch size ({c.minibatch_size} = rollout.batch_size "
            f"{r.batch_size} / ppo.num_minibatches {p.num_minibatches})",
        )
    if r.num_samples_per_prompt < 2 and ADVANTAGE_ESTIMATORS.trait(p.advantage_estimator, "needs_groups"):
        raise ConfigError(
            "ppo.advantage_estimator",
            p.advantage_estimator,
            "compares responses to the same prompt: set rollout.num_samples_per_prompt >= 2",
        )
    if p.grpo_scale != "group" and not ADVANTAGE_ESTIMATORS.trait(p.advantage_estimator, "group_scale"):
        raise ConfigError(
            "ppo.grpo_scale",
            p.grpo_scale,
            f"scales a group-centred advantage (`grpo`); ppo.advantage_estimator `{p.advantage_estimator}` has no "
            "group scale: use `group` (the default) or advantage_estimator `grpo`",
        )
    if p.grpo_scale != "group" and p.whiten_advantages:
        raise ConfigError(
            "ppo.grpo_scale",
            p.grpo_scale,
            "needs ppo.whiten_advantages false: whitening divides every advantage by the batch's std afterwards, "
            "which undoes `none` and makes `batch` the same as `none`",
        )
    if p.loss_aggregation == "fixed_length" and c.environment.path:
        raise ConfigError(
            "ppo.loss_aggregation",
            p.loss_aggregation,
            "divides by rollout.max_new_tokens per response, and an environment's episodes have several turns "
            "(environment.path is set): use `token_mean` or `sequence_mean`",
        )
    if c.data.retire_settled_after and r.num_samples_per_prompt < 2:
        raise ConfigError(
            "data.retire_settled_after",
            c.data.retire_settled_after,
            "reads whether a prompt's group of responses all scored alike: set rollout.num_samples_per_prompt >= 2 "
            "(or 0 to turn the filter off)",
        )


def check_log(c: Config) -> None:
    if c.log.eval_every and not c.data.holdout:
        raise ConfigError(
            "log.eval_every",
            c.log.eval_every,
            "needs held-out prompts to evaluate on: set data.holdout > 0 (or log.eval_every = 0)",
        )


def check_reward(rc: RewardConfig, with_environment: bool = False) -> None:
    """At least one source (none with an environment: its step rewards are the reward); each source's kind, path,
    input, weight and headers."""
    if not rc.sources and not with_environment:
        raise ConfigError(
            "reward.sources", rc.sources, "needs at least one reward source (or an environment: environment.path)"
        )
    for i, s in enumerate(rc.sources):
        where = f"reward.sources[{i}]"
        if not s.path:
            raise ConfigError(f"{where}.path", s.path, "is empty; give a model folder, `module:function` or a URL")
        if s.kind == "model":
            check_model_path(s.path, f"{where}.path")
        if s.kind == "function" and ":" not in s.path:
            raise ConfigError(f"{where}.path", s.path, "must look like `module:function` or `file.py:function`")
        if s.kind == "http" and not re.match(r"^https?://", s.path):
            raise ConfigError(f"{where}.path", s.path, "must be an http:// or https:// URL")
        if s.input == "tokens" and s.kind != "model":
            raise ConfigError(
                f"{where}.input",
                s.input,
                f"is for reward models (kind `model`); a `{s.kind}` source "
                "gets text (a function can also take `completion_ids`)",
            )
        if s.weight != s.weight:
            raise ConfigError(f"{where}.weight", s.weight, "must be a number")
        if s.headers and s.kind != "http":
            raise ConfigError(f"{where}.headers", s.headers, f"are for `http` sources; this source is `{s.kind}`")
        http_headers(s, where)


FLOAT_RANGES: dict[str, tuple[float, float]] = {
    # every float field is finite; these are the ranges where a value means something (shown in --help).
    # Field names of list items (reward.sources[i].weight) are written without the index.
    "model.lora.alpha": (0.0, 1e6),
    "rollout.temperature": (1e-2, 1e2),
    "reward.sources.weight": (-1e6, 1e6),
    "reward.sources.timeout": (1e-3, 86400.0),
    "reward.penalty": (-1e6, 1e6),
    "reward.overlong_penalty": (0.0, 1e6),
    "reward.clip": (0.0, 1e6),
    "kl.coef": (0.0, 1e3),
    "kl.kp": (0.0, 1e3),
    "kl.ki": (0.0, 1e3),
    "kl.coef_min": (0.0, 1e3),
    "kl.coef_max": (0.0, 1e6),
    "kl.warn_below": (-1e6, 1e6),
    "ppo.learning_rate": (0.0, 1.0),
    "ppo.weight_decay": (0.0, 1e3),
    "ppo.adam_eps": (0.0, 1.0),
    "ppo.clip_range": (0.0, 1e3),
    "ppo.value_clip_range": (0.0, 1e6),
    "ppo.vf_coef": (0.0, 1e3),
    "ppo.entropy_coef": (0.0, 1e3),
    "ppo.target_kl": (0.0, 1e6),
    "ppo.max_grad_norm": (0.0, 1e6),
}
"""Allowed range of float fields (both ends included; the checks of `validate` may be stricter, e.g. > 0)."""


def check_floats(obj: DataclassInstance, prefix: str, generic: str = "") -> None:
    """Every float field of `obj` (sections and lists of sections included) is within FLOAT_RANGES."""
    hints = type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, tp = getattr(obj, f.name), hints[f.name]
        name, key = prefix + f.name, (generic or prefix) + f.name
        if dataclasses.is_dataclass(tp):
            check_floats(value, name + ".", key + ".")
        elif typing.get_origin(tp) is list and value and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            for i, item in enumerate(value):
                check_floats(item, f"{name}[{i}].", key + ".")
        elif tp is float and key in FLOAT_RANGES:
            low, high = FLOAT_RANGES[key]
            if not low <= value <= high:
                raise ConfigError(name, value, f"must be within [{low:g}, {high:g}]")


def _positive(value: float, name: str) -> None:
    if not value > 0:
        raise ConfigError(name, value, "must be > 0")


def _non_negative(value: float, name: str) -> None:
    if not value >= 0:
        raise ConfigError(name, value, "must be >= 0")


def _in_range(value: float, name: str, low: float, high: float, high_open: bool = False) -> None:
    ok = low <= value < high if high_open else low <= value <= high
    if not ok:
        raise ConfigError(name, value, f"must be in [{low}, {high}{')' if high_open else ']'}")
