"""Checkpointing a trainer and resuming a run: the trainer's `TrainingState` to the checkpoint format
(`lmppo.run.checkpoint`) and back, and the config checks that refuse a resume which would mean something else.
The design (what exact resume restores, and why): docs/checkpoints.md."""

from __future__ import annotations

import contextlib
import copy
import os
import uuid
from typing import TYPE_CHECKING, Callable, Collection, Optional, Protocol, Sequence, TypedDict, TypeVar

from torch import nn

from lmppo.config import Config, apply_override, from_dict, load_config
from lmppo.data.prompts import run_prompt_records
from lmppo.distributed.zero import requested_zero_stage
from lmppo.errors import CheckpointError, ConfigError
from lmppo.models.optim import lr_factor
from lmppo.run.checkpoint import (
    ModelParts,
    check_layout,
    frozen_fingerprint,
    read_checkpoint,
    read_state_file,
    save_checkpoint,
)
from lmppo.run.config_file import masked_fields, redacted_config_dict
from lmppo.run.folder import checkpoint_folder_run, list_checkpoints, truncate_logs
from lmppo.run.layout import CONFIG, set_aside_name
from lmppo.run.manifest import resolve_checkpoint
from lmppo.run.state import RngState, TrainingState
from lmppo.training.inputs import (
    ACCEPT_FLAG,
    Fingerprints,
    check_unchanged,
    fingerprint_records,
    model_fingerprints,
    moved_folders,
)

if TYPE_CHECKING:
    from accelerate import Accelerator
    from rich.console import Console
    from transformers import PreTrainedTokenizerBase
    from typing_extensions import Unpack

    from lmppo.core.kl_control import KLController
    from lmppo.core.rewards import RunningMoments
    from lmppo.data.prompts import PromptStream
    from lmppo.distributed.strategy import Strategy
    from lmppo.environments.factories import Factories
    from lmppo.models.reference import ReferencePolicy
    from lmppo.training.updater import Updater


class TrainerObjects(TypedDict, total=False):
    """The objects a trainer takes besides its config (`lmppo.training.trainer.PPOTrainer`), as a resume passes them."""

    policy: Optional[nn.Module]
    tokenizer: Optional[PreTrainedTokenizerBase]
    prompts: Optional[Sequence]
    reward_functions: dict[str, Callable] | Sequence[Callable] | None
    value_model: Optional[nn.Module]
    ref_model: Optional[nn.Module]
    callbacks: object
    environment_factory: Optional[Factories]
    tools: Sequence[Callable]


class CheckpointedTrainer(Protocol):
    """What checkpointing reads and restores of `lmppo.training.trainer.PPOTrainer` (which imports this module)."""

    config: Config
    accelerator: Accelerator
    strategy: Strategy
    actor: nn.Module  # the wrapped lmppo.models.loading.Actor
    critic: Optional[nn.Module]  # the wrapped lmppo.models.loading.Critic, or None
    reference: ReferencePolicy
    updater: Updater  # the optimizer, its schedule, the minibatch-order generator, the non-finite streak
    kl_controller: KLController
    score_moments: RunningMoments
    stream: PromptStream
    iteration: int
    episode: int
    train_seconds: float
    fingerprints: Fingerprints  # of the frozen weights and of the prompt data and model folders it trains on

    def __init__(
        self, config: Config, *, console: Optional[Console], resuming: bool, **kwargs: Unpack[TrainerObjects]
    ) -> None: ...


Trainer = TypeVar("Trainer", bound=CheckpointedTrainer)


INCOMPATIBLE_FIELDS = (
    "model.policy",
    "model.tokenizer",
    "model.lora.enabled",
    "model.lora.r",
    "model.lora.alpha",
    "model.lora.target_modules",
    "value.mode",
    "rollout.batch_size",
    "ppo.num_minibatches",
    "seed",
    "data.shuffle",
    "reference.mode",
    "kl.controller",
)
"""Fields a resumed run must keep: the checkpoint cannot be loaded, or would mean something else, with another
value (`value.init_from` too when value.mode is `critic`). Everything else may change on resume: total_episodes
(extend a run), log.*, checkpoint.*, learning rate and schedule (applied from the next iteration), kl.coef (fixed
controller; the adaptive controller continues from its checkpointed value), micro_batch_size, ..."""


def _get(data: object, dotted: str) -> object:
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def check_compatible(cfg: Config, saved: dict, where: str, moved: Collection[str] = ()) -> None:
    """ConfigError naming the first field of `INCOMPATIBLE_FIELDS` whose value in `cfg` differs from the
    checkpointed config `saved` (a redacted dict); `moved`: model fields whose new folder holds the same files as
    the recorded one (`lmppo.training.inputs.moved_folders`), taken as unchanged."""
    new = redacted_config_dict(cfg)
    fields = list(INCOMPATIBLE_FIELDS)
    if _get(new, "value.mode") == "critic":
        fields.append("value.init_from")
    for name in (f for f in fields if f not in moved):
        old_value, new_value = _get(saved, name), _get(new, name)
        if old_value != new_value:
            raise ConfigError(
                name,
                new_value,
                f"cannot change when resuming: the checkpoint {where} was trained "
                f"with {old_value!r}. Keep {name} = {old_value!r}, or start a new run in another "
                "output_dir",
            )


def _check_length(cfg: Config, state: dict, where: str) -> None:
    if state["iteration"] > cfg.num_iterations:
        raise ConfigError(
            "total_episodes",
            cfg.total_episodes,
            f"is less than the {state['episode']} episodes the "
            f"checkpoint {where} has already trained; give at least that many (more to go on)",
        )


# ----------------------------------------------------------------------------- trainer <-> TrainingState


def model_parts(trainer: CheckpointedTrainer) -> ModelParts:
    unwrap = trainer.accelerator.unwrap_model
    return ModelParts(
        modules={
            "actor.": unwrap(trainer.actor),
            "critic.": unwrap(trainer.critic) if trainer.critic is not None else None,
        },
        engine=trainer.actor,
        strategy=trainer.strategy,
        accelerator=trainer.accelerator,
        reference_partitioned=trainer.reference.partitioned,
    )


def _fingerprint(trainer: CheckpointedTrainer, parts: ModelParts) -> str:
    if trainer.fingerprints.frozen is None:  # frozen weights never change: hashed once
        trainer.fingerprints.frozen = frozen_fingerprint(parts.modules)
    return trainer.fingerprints.frozen


def capture_state(trainer: CheckpointedTrainer, parts: ModelParts) -> TrainingState:
    """The trainer's state as a checkpoint holds it."""
    keeps_reference = trainer.accelerator.is_main_process or trainer.reference.partitioned
    return TrainingState(
        iteration=trainer.iteration,
        episode=trainer.episode,
        train_seconds=trainer.train_seconds,
        nonfinite_in_a_row=trainer.updater.nonfinite_in_a_row,
        stream=trainer.stream.state_dict(),
        kl_controller=trainer.kl_controller.state_dict(),
        score_moments=trainer.score_moments.state_dict(),
        scheduler={k: v for k, v in trainer.updater.scheduler.state_dict().items() if k != "lr_lambdas"},
        reference=trainer.reference.state_dict() if keeps_reference else {},
        update_generator=trainer.updater.generator.get_state(),
        rng=RngState.capture(),
        frozen_fingerprint=_fingerprint(trainer, parts),
        optimizer=None if trainer.strategy.sharded_checkpoint else trainer.updater.optimizer.state_dict(),
        config=redacted_config_dict(trainer.config),
        inputs=dict(trainer.fingerprints.inputs),
    )


def checkpoint_trainer(trainer: CheckpointedTrainer) -> str:
    """Write the trainer's complete state to `output_dir/checkpoints/iter-N` (`lmppo.run.checkpoint`)."""
    parts = model_parts(trainer)
    state = capture_state(trainer, parts)
    return save_checkpoint(trainer.config.output_dir, state, parts, trainer.config.checkpoint.keep_last)


def _apply_changed_optimisation(trainer: CheckpointedTrainer, saved: dict) -> None:
    """Optimizer settings come back from the checkpoint; apply the ones the resumed config changed."""
    p = trainer.config.ppo
    for group in trainer.updater.optimizer.param_groups:
        group["eps"], group["weight_decay"] = p.adam_eps, p.weight_decay
    schedule = {
        "ppo.learning_rate": p.learning_rate,
        "ppo.lr_schedule": p.lr_schedule,
        "ppo.warmup_iterations": p.warmup_iterations,
        "total_episodes": trainer.config.total_episodes,
    }
    if all(_get(saved, k) == v for k, v in schedule.items()):
        return
    sched = trainer.updater.scheduler
    factor = lr_factor(sched.last_epoch, p, trainer.config.num_iterations)
    sched.base_lrs = [p.learning_rate for _ in sched.base_lrs]
    for group in trainer.updater.optimizer.param_groups:
        group["initial_lr"] = p.learning_rate
        group["lr"] = p.learning_rate * factor
    sched._last_lr = [group["lr"] for group in trainer.updater.optimizer.param_groups]


def restore_state(trainer: CheckpointedTrainer, state: TrainingState) -> None:
    """Set the trainer to `state` (its trained tensors are already loaded); the RNGs last."""
    if state.optimizer is not None:
        trainer.updater.optimizer.load_state_dict(state.optimizer)
    trainer.reference.load_state_dict(state.reference)
    trainer.updater.scheduler.load_state_dict(
        {**state.scheduler, "lr_lambdas": [None] * len(trainer.updater.scheduler.lr_lambdas)}
    )
    _apply_changed_optimisation(trainer, state.config)
    if trainer.config.kl.controller != "fixed":  # a fixed coefficient comes from the config (it may change on resume)
        trainer.kl_controller.load_state_dict(state.kl_controller)
    trainer.score_moments.load_state_dict(state.score_moments)
    trainer.stream.load_state_dict(state.stream)
    trainer.iteration, trainer.episode = state.iteration, state.episode
    trainer.train_seconds = state.train_seconds
    trainer.updater.nonfinite_in_a_row = state.nonfinite_in_a_row
    trainer.updater.generator.set_state(state.update_generator)
    state.rng.restore()  # last: nothing may draw from them between here and the next iteration


def load_trainer_checkpoint(
    trainer: CheckpointedTrainer, path: Optional[str] = None, *, verified: bool = False, moved: Collection[str] = ()
) -> str:
    """Restore the trainer from checkpoint folder `path` (default: the latest one in its output_dir); returns
    the folder. The trainer's config must be compatible (`check_compatible`). metrics.jsonl and samples.jsonl
    of the trainer's output_dir are cut back to the checkpoint's iteration, so the continued run adds no
    line twice. `moved`: as `check_compatible`."""
    path = path or trainer.config.output_dir
    path = path if verified else resolve_checkpoint(path)
    cfg = trainer.config
    saved = read_state_file(path)
    check_compatible(cfg, saved.get("config", {}), path, moved)
    _check_length(cfg, saved, path)
    parts = model_parts(trainer)
    if saved.get("frozen_fingerprint") != _fingerprint(trainer, parts):
        raise CheckpointError(
            f"checkpoint {path}: the frozen weights (LoRA base model, frozen layers) differ from "
            "the ones it was trained with; resume from the same initial policy (model.policy)"
        )
    stage = int(trainer.strategy.checkpoint_layout().get("deepspeed_stage", 0))
    check_layout(saved, trainer.accelerator.num_processes, stage, path)
    restore_state(trainer, read_checkpoint(path, parts))
    if trainer.accelerator.is_main_process:
        truncate_logs(cfg.output_dir, trainer.iteration, trainer.episode)
    return path


def _resume_config(output_dir: str, saved: dict, config: Optional[Config], config_path: Optional[str], overrides):
    """`config`, else the file `config_path`, else the run's own config.yaml (else the checkpoint's), with
    `overrides`; a secret masked when the run was saved is refused."""
    if config is not None:
        cfg = copy.deepcopy(config)
        for dotted, raw in (overrides or {}).items():
            apply_override(cfg, dotted, raw)
        return cfg
    if config_path:
        return load_config(config_path, overrides)
    own = os.path.join(output_dir, CONFIG)
    if os.path.isfile(own):
        cfg = load_config(own, overrides)
    else:
        cfg = from_dict(Config, saved.get("config", {}))
        for dotted, raw in (overrides or {}).items():
            apply_override(cfg, dotted, raw)
    masked = masked_fields(cfg.to_dict())
    if masked:
        raise ConfigError(
            masked[0][0],
            masked[0][1],
            "holds a secret that was masked when the run was saved; give the run's own config "
            f"file again (`lmppo train CONFIG.yaml --resume {output_dir}`) or override the field",
        )
    return cfg


def resume_trainer(
    output_dir: str,
    overrides: Optional[dict] = None,
    config_path: Optional[str] = None,
    console: Optional[Console] = None,
    *,
    config: Optional[Config] = None,
    trainer_cls: type[Trainer],
    accept_changed_inputs: bool = False,
    **trainer_kwargs: Unpack[TrainerObjects],
) -> Trainer:
    """A trainer that continues the run in `output_dir` from its latest complete checkpoint.

    The config is `config` (a Config), else the file `config_path`, else the run's own `output_dir/config.yaml`
    (falling back to the one stored in the checkpoint), with `overrides` (dotted name -> value) applied and
    `output_dir` set to the run's folder. A change that makes the checkpoint unusable is refused with a
    ConfigError naming the field and both values, before any model is loaded. `trainer_kwargs` (policy,
    tokenizer, prompts, reward_functions) are passed to `trainer_cls` (`PPOTrainer`; `PPOTrainer.resume` calls
    this) as for a new run, with `resuming=True`: give the same initial policy and prompts the run started with.
    Prompt data or a model folder whose content differs from what the checkpoint recorded is refused (ConfigError
    naming it) unless `accept_changed_inputs`; a model folder moved with its content unchanged is accepted.
    """
    if not os.path.isdir(output_dir):
        raise CheckpointError(f"cannot resume from {output_dir}: no such folder")
    run = checkpoint_folder_run(output_dir)
    if run is not None:  # resuming "into" a checkpoint folder would make it the run folder
        raise CheckpointError(
            f"cannot resume from {output_dir}: it is a checkpoint folder of the run {run}; resume "
            f"takes the run folder (`lmppo train --resume {run}`), which continues from its "
            "latest complete checkpoint"
        )
    path = resolve_checkpoint(output_dir)
    saved = read_state_file(path)
    cfg = _resume_config(output_dir, saved, config, config_path, overrides)
    cfg.output_dir = output_dir
    decided = _get(saved.get("config", {}), "precision")
    if cfg.precision == "auto" and decided in ("fp32", "bf16"):  # decided once, when the run started
        cfg.precision = decided
    recorded = saved.get("inputs") or {}
    moved = moved_folders(cfg, saved.get("config", {}), recorded)
    check_compatible(cfg, saved.get("config", {}), path, moved)
    _check_length(cfg, saved, path)
    current = {
        "data.prompts": fingerprint_records(run_prompt_records(cfg, trainer_kwargs.get("prompts"))),
        **model_fingerprints(cfg),
    }
    changed = check_unchanged(cfg, recorded, current, path, accept_changed_inputs)
    for field, old in moved.items():
        _say(console, f"{field}: the folder holds the same files as {old}, where the run began: resuming")
    if changed:
        _say(console, f"resuming on changed inputs ({', '.join(changed)}), as {ACCEPT_FLAG} asks")
    # the launcher's number of processes and the ZeRO stage, before any model loads (checked again once started)
    check_layout(saved, int(os.environ.get("WORLD_SIZE", "1")), requested_zero_stage(cfg), path, warn=False)
    trainer = trainer_cls(cfg, console=console, resuming=True, **trainer_kwargs)
    stale = [p for i, p in list_checkpoints(output_dir) if i > saved["iteration"]]
    for p in stale if trainer.accelerator.is_main_process else []:
        # newer checkpoints that failed verification: set aside so they are neither used nor pruned
        with contextlib.suppress(OSError):
            os.rename(p, os.path.join(os.path.dirname(p), set_aside_name(os.path.basename(p), uuid.uuid4().hex[:6])))
    load_trainer_checkpoint(trainer, path, verified=True, moved=moved)
    if console is not None:
        done = trainer.iteration >= cfg.num_iterations
        console.print(
            f"resuming {output_dir} from {path}: iteration {trainer.iteration}/{cfg.num_iterations}, "
            f"episode {trainer.episode}" + (" (already complete: raise total_episodes to go on)" if done else ""),
            highlight=False,
        )
    return trainer


def _say(console: Optional[Console], line: str) -> None:
    if console is not None:
        console.print(line, highlight=False, soft_wrap=True)
