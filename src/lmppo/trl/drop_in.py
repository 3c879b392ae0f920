"""A drop-in for TRL 1.12's PPO: ``from lmppo.trl import PPOConfig, PPOTrainer`` replaces
``from trl.experimental.ppo import PPOConfig, PPOTrainer`` (TRL removed its PPOTrainer after 1.12).

``PPOConfig`` has TRL 1.12's fields with their names, types and defaults (TRL's ``PPOConfig`` is
``transformers.TrainingArguments`` plus TRL's base-config overrides plus the PPO fields, so this one is built the
same way) and parses with ``transformers.HfArgumentParser``. ``PPOTrainer`` takes TRL 1.12's constructor arguments
and offers what such scripts use (``train``, ``save_model``, ``generate_completions``, ``state.log_history``,
callbacks with ``on_log`` / ``on_step_end`` / ``on_save`` / ``on_train_begin`` / ``on_train_end``), built on lmppo's
own ``Config`` and ``lmppo.training.trainer.PPOTrainer``. The objects passed in are used as given: the value model's
backbone
and ``score`` head are the critic, the reward model reads the sampled token ids as TRL's does, the reference model
is the frozen reference (``ref_model=None`` with a ``peft_config``: the policy with its adapters switched off).

Every field is either translated to lmppo's config (``lmppo_config`` says how), or has no effect in TRL 1.12's
PPOTrainer either (accepted, listed in ``NO_EFFECT_IN_TRL``), or is refused with a ``ConfigError`` naming it when
set to a value lmppo cannot honour. How lmppo departs from TRL, field by field: docs/migrating_from_trl.md. The main
ones: the score sits on the stop token (TRL puts it one past it); ``max_grad_norm`` is applied (TRL 1.12 never clips);
with gradient accumulation the loss is the token mean over the whole minibatch (TRL averages micro-batch means);
prompts are always left-padded; the random streams differ, so one seed does not give TRL's samples.

``ScriptArguments``, ``ModelConfig``, ``TrlParser``, ``get_peft_config`` and ``get_quantization_config`` are here too
(TRL 1.12's), so a script's ``from trl import ...`` line can point here as well when TRL is not installed.
"""

import copy
import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import torch
from torch import nn
from transformers import HfArgumentParser, TrainerState, TrainingArguments

from lmppo.config import Config, DataConfig, field_docs
from lmppo.data.hf_datasets import is_hf_dataset
from lmppo.data.prompts import load_prompt_records
from lmppo.errors import ConfigError, LmppoError
from lmppo.models.loading import hf_model
from lmppo.rewards import ModelSource, SourceContext
from lmppo.sampling.hf import left_pad
from lmppo.sampling.native import response_seed, sample_native
from lmppo.training.trainer import PPOTrainer as LmppoTrainer

TRL_LOG_KEYS = (
    "eps",
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/scores",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "loss/policy_avg",
    "loss/value_avg",
    "val/clipfrac_avg",
    "policy/entropy_avg",
    "val/ratio",
    "val/ratio_var",
    "val/num_eos_tokens",
    "lr",
    "episode",
)
"""The metrics TRL 1.12's PPOTrainer logs every update (then `epoch`, and `step` in `state.log_history`), in its
order. lmppo's own, more numerous metrics stay in OUTPUT_DIR/metrics.jsonl and `PPOTrainer.lmppo_history`."""

DOCS = "docs/migrating_from_trl.md"


# ============================================================================ PPOConfig


@dataclass
class PPOConfig(TrainingArguments):
    """TRL 1.12's `PPOConfig`: `transformers.TrainingArguments` with TRL's base-config overrides and the PPO fields.
    The docstring under each field says what it becomes in lmppo's own config (also the `--help` text)."""

    # -- TRL's base-config overrides of TrainingArguments (trl/trainer/base_config.py)
    logging_steps: float = 10
    """Accepted with TRL's meaning for PPO: none. TRL 1.12's PPOTrainer logs every update whatever this is, and so
    does lmppo."""
    gradient_checkpointing: bool = True
    """No effect, as in TRL 1.12 (its PPOTrainer never turns gradient checkpointing on, although the default is
    True); lmppo does not either."""
    bf16: bool | None = None
    """True (the default when fp16 is not set) -> lmppo `precision: auto` (bf16 autocast where this machine runs
    it faster); False -> `precision: fp32`. TRL 1.12's PPOTrainer builds its Accelerator without mixed precision,
    so there bf16 changes nothing."""
    lr_scheduler_kwargs: dict | str | None = None
    """Refused unless empty: lmppo's schedules take no extra arguments."""
    use_liger_kernel: bool = False
    """No effect, as in TRL 1.12's PPOTrainer (it bypasses the Trainer set-up that applies it)."""
    torch_empty_cache_steps: int | None = None
    """No effect, as in TRL 1.12's PPOTrainer."""
    # -- PPO fields (trl/experimental/ppo/ppo_config.py), in TRL's order
    learning_rate: float = 3e-6
    """-> ppo.learning_rate (AdamW)."""
    dataset_num_proc: int | None = None
    """No effect in TRL 1.12's PPOTrainer (scripts pass it to `dataset.map`); none in lmppo."""
    num_mini_batches: int = 1
    """-> ppo.num_minibatches (one optimizer step each)."""
    total_episodes: int | None = None
    """-> total_episodes, rounded up to whole batches as TRL trains ceil(total_episodes / batch_size) updates.
    None: num_train_epochs x the training set's size."""
    local_rollout_forward_batch_size: int = 64
    """-> rollout.forward_batch_size (sequences per no-grad forward pass in the rollout)."""
    num_sample_generations: int = 10
    """Calls of `generate_completions(sampling=True)` during training, spread as in TRL (needs an eval_dataset)."""
    response_length: int = 53
    """-> rollout.max_new_tokens."""
    stop_token: Literal["eos"] | None = None
    """`eos` -> rollout.stop_token `eos`; None (and no stop_token_id) -> `none`: every response runs to
    response_length, as in TRL."""
    stop_token_id: int | None = None
    """-> rollout.stop_token, the token with this id. Exclusive with stop_token."""
    temperature: float = 0.7
    """-> rollout.temperature = temperature + 1e-7, as TRL samples and divides the logits (0 is refused: lmppo
    samples at a temperature)."""
    missing_eos_penalty: float | None = None
    """-> reward.truncation `penalty` with penalty = -missing_eos_penalty, penalty_mode `add`: subtracted from the
    score of a response without the stop token (TRL: without the eos token). Needs a stop token."""
    sft_model_path: str = "EleutherAI/pythia-160m"
    """Read by scripts to load the policy; not by TRL 1.12's PPOTrainer, nor by lmppo."""
    world_size: int | None = None
    """Computed by the trainer (number of processes), as in TRL."""
    num_total_batches: int | None = None
    """Computed by the trainer: ceil(total_episodes / batch_size) updates, as in TRL."""
    micro_batch_size: int | None = None
    """Computed by the trainer: per_device_train_batch_size x world_size, as in TRL."""
    local_batch_size: int | None = None
    """Computed by the trainer: per_device_train_batch_size x gradient_accumulation_steps, as in TRL."""
    batch_size: int | None = None
    """Computed by the trainer: local_batch_size x world_size (= lmppo's rollout.batch_size), as in TRL."""
    local_mini_batch_size: int | None = None
    """Computed by the trainer: local_batch_size / num_mini_batches, as in TRL."""
    mini_batch_size: int | None = None
    """Computed by the trainer: batch_size / num_mini_batches, as in TRL."""
    push_to_hub: bool = False
    """Refused when True: lmppo does not upload models."""
    reward_model_path: str = "EleutherAI/pythia-160m"
    """Read by scripts to load the reward and value models; not by TRL 1.12's PPOTrainer, nor by lmppo."""
    model_adapter_name: str | None = None
    """Refused unless None: lmppo trains the PEFT model's active adapter only."""
    ref_adapter_name: str | None = None
    """Refused unless None: a LoRA reference is the policy with its adapters off (model.lora, reference.mode)."""
    num_ppo_epochs: int = 4
    """-> ppo.num_epochs."""
    whiten_rewards: bool = False
    """Refused when True: lmppo does not whiten per-token rewards (see reward.normalize for score normalisation)."""
    kl_coef: float = 0.05
    """-> kl.coef with kl.controller `fixed` and kl.placement `reward`, as in TRL."""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """-> kl.estimator (`k1` or `k3`)."""
    cliprange: float = 0.2
    """-> ppo.clip_range."""
    vf_coef: float = 0.1
    """-> ppo.vf_coef."""
    cliprange_value: float = 0.2
    """-> ppo.value_clip_range."""
    gamma: float = 1.0
    """-> ppo.gamma."""
    lam: float = 0.95
    """-> ppo.lam."""
    ds3_gather_for_generation: bool = True
    """True: lmppo's ZeRO-3 support always gathers the policy for generation. False is refused."""

    def __post_init__(self):
        self.bf16 = not self.fp16 if self.bf16 is None else self.bf16  # as TRL's base config
        super().__post_init__()


def _docs_as_help(cls: type) -> None:
    """HfArgumentParser reads a field's `help` metadata: make it the docstring written under the field."""
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in docs:
            f.metadata = MappingProxyType({**f.metadata, "help": docs[f.name].replace("%", "%%")})


_docs_as_help(PPOConfig)

# How every other TrainingArguments field is treated. Each field of PPOConfig is in exactly one of: the fields
# `lmppo_config` translates (MAPPED), NO_EFFECT_IN_TRL, REFUSED_UNLESS_DEFAULT (tests/test_trl.py checks this).
MAPPED = (
    "output_dir",
    "per_device_train_batch_size",
    "num_train_epochs",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "optim",
    "weight_decay",
    "adam_epsilon",
    "gradient_accumulation_steps",
    "max_grad_norm",
    "bf16",
    "fp16",
    "seed",
    "use_cpu",
    "report_to",
    "run_name",
    "project",
    "trackio_space_id",
    "trackio_bucket_id",
    "trackio_static_space_id",
    "disable_tqdm",
    "save_strategy",
    "save_steps",
    "save_total_limit",
    "per_device_eval_batch_size",
    "deepspeed",
    "push_to_hub",
    "num_mini_batches",
    "total_episodes",
    "local_rollout_forward_batch_size",
    "num_sample_generations",
    "response_length",
    "stop_token",
    "stop_token_id",
    "temperature",
    "missing_eos_penalty",
    "world_size",
    "num_total_batches",
    "micro_batch_size",
    "local_batch_size",
    "batch_size",
    "local_mini_batch_size",
    "mini_batch_size",
    "num_ppo_epochs",
    "kl_coef",
    "kl_estimator",
    "cliprange",
    "vf_coef",
    "cliprange_value",
    "gamma",
    "lam",
    "ds3_gather_for_generation",
    "model_adapter_name",
    "ref_adapter_name",
    "whiten_rewards",
    "lr_scheduler_kwargs",
    "adam_beta1",
    "adam_beta2",
    "optim_args",
    "optim_target_modules",
    "fsdp",
    "fsdp_config",
    "include_num_input_tokens_seen",
    "logging_steps",
)
"""Fields `lmppo_config` / the trainer read (translated, or refused for values lmppo cannot honour)."""

NO_EFFECT_IN_TRL = (
    # TRL 1.12's PPOTrainer never runs Trainer.__init__, an evaluation loop, HF's DataLoader set-up, or Trainer.train:
    # these fields change nothing there, and nothing in lmppo
    "max_steps",
    "activation_checkpointing",
    "activation_checkpointing_kwargs",
    "gradient_checkpointing",
    "gradient_checkpointing_kwargs",
    "average_tokens_across_devices",
    "label_smoothing_factor",
    "bf16_full_eval",
    "fp16_full_eval",
    "tf32",
    "torch_compile",
    "torch_compile_backend",
    "torch_compile_mode",
    "use_liger_kernel",
    "liger_kernel_config",
    "use_cache",
    "neftune_noise_alpha",
    "torch_empty_cache_steps",
    "auto_find_batch_size",
    "logging_strategy",
    "logging_first_step",
    "log_on_each_node",
    "logging_nan_inf_filter",
    "log_level",
    "log_level_replica",
    "eval_strategy",
    "eval_steps",
    "eval_delay",
    "prediction_loss_only",
    "eval_on_start",
    "eval_do_concat_batches",
    "eval_use_gather_object",
    "eval_accumulation_steps",
    "include_for_metrics",
    "batch_eval_metrics",
    "save_only_model",
    "save_on_each_node",
    "enable_jit_checkpoint",
    "hub_token",
    "hub_private_repo",
    "hub_model_id",
    "hub_strategy",
    "hub_always_push",
    "hub_revision",
    "load_best_model_at_end",
    "metric_for_best_model",
    "greater_is_better",
    "ignore_data_skip",
    "restore_callback_states_from_checkpoint",
    "full_determinism",
    "data_seed",
    "accelerator_config",
    "parallelism_config",
    "dataloader_drop_last",
    "dataloader_num_workers",
    "dataloader_pin_memory",
    "dataloader_persistent_workers",
    "dataloader_prefetch_factor",
    "dataloader_multiprocessing_context",
    "dataloader_in_order",
    "remove_unused_columns",
    "label_names",
    "train_sampling_strategy",
    "length_column_name",
    "ddp_find_unused_parameters",
    "ddp_bucket_cap_mb",
    "ddp_broadcast_buffers",
    "ddp_static_graph",
    "ddp_backend",
    "ddp_timeout",
    "debug",
    "skip_memory_metrics",
    "do_train",
    "do_eval",
    "do_predict",
    "resume_from_checkpoint",
    "local_rank",
    "dataset_num_proc",
    "sft_model_path",
    "reward_model_path",
)
"""TrainingArguments / PPOConfig fields that TRL 1.12's PPOTrainer does not read (scripts may): accepted with any
value, no effect in lmppo either (tf32 and ddp_timeout act through TrainingArguments itself, identically)."""

REFUSED_UNLESS_DEFAULT = {
    "fp16": "lmppo has no fp16 mode; use bf16 (precision `auto` / `bf16`) or fp32",
    "lr_scheduler_kwargs": "lmppo's learning-rate schedules (constant, linear, cosine) take no extra arguments",
    "adam_beta1": "lmppo's AdamW uses beta1 = 0.9",
    "adam_beta2": "lmppo's AdamW uses beta2 = 0.999",
    "optim_args": "lmppo's AdamW takes no extra optimizer arguments",
    "optim_target_modules": "lmppo optimises every trainable parameter with AdamW",
    "fsdp": "lmppo has no FSDP support; use DeepSpeed ZeRO (the `deepspeed` field) for sharding",
    "fsdp_config": "lmppo has no FSDP support; use DeepSpeed ZeRO (the `deepspeed` field) for sharding",
    "include_num_input_tokens_seen": "lmppo does not add `num_input_tokens_seen` to the logs",
    "push_to_hub": "the trainer does not upload models; save_model() writes a Hugging Face folder, and "
    "`lmppo push FOLDER --repo-id ORG/NAME` uploads it",
    "model_adapter_name": "lmppo trains the PEFT model's active adapter only",
    "ref_adapter_name": "lmppo's LoRA reference is the policy with its adapters switched off (ref_model=None)",
    "whiten_rewards": "lmppo does not whiten per-token rewards; reward.normalize (running mean/std of scores) is the "
    "nearest setting of lmppo's own config",
    "ds3_gather_for_generation": "lmppo's ZeRO-3 support always gathers the policy's weights for generation",
}
"""Fields lmppo accepts only at TRL's default value: any other is a ConfigError naming the field."""

SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")


def _default(name: str) -> Any:
    f = PPOConfig.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _refuse(name: str, value: Any, why: str) -> ConfigError:
    return ConfigError(name, value, f"{why} (TRL PPOConfig field; see {DOCS})")


def check_fields(args: PPOConfig) -> None:
    """ConfigError for the first field set to a value lmppo cannot honour."""
    for name, why in REFUSED_UNLESS_DEFAULT.items():
        value, default = getattr(args, name), _default(name)
        if name == "include_num_input_tokens_seen":
            default = "no"  # TrainingArguments turns False into "no"
        if value != default and not (value in (None, {}, "") and default in (None, {}, "")):
            raise _refuse(name, value, why)
    schedule = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if schedule not in SCHEDULES:
        raise _refuse("lr_scheduler_type", schedule, "lmppo's schedules are " + ", ".join(f"`{s}`" for s in SCHEDULES))
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in OPTIMIZERS:
        raise _refuse("optim", optim, "lmppo trains with AdamW (`adamw_torch` or `adamw_torch_fused`)")
    save = str(getattr(args.save_strategy, "value", args.save_strategy))
    if save not in ("no", "steps"):
        raise _refuse(
            "save_strategy",
            save,
            "lmppo checkpoints every N iterations (`steps`) or only at the end "
            "(`no`); a PPO run has no epochs or best model",
        )
    if isinstance(args.deepspeed, dict):
        raise _refuse("deepspeed", "{...}", "give lmppo a DeepSpeed JSON file path, `zero2` or `zero3`")
    if args.stop_token and args.stop_token_id is not None:
        raise _refuse("stop_token_id", args.stop_token_id, "is exclusive with stop_token (TRL refuses both too)")
    if args.stop_token not in (None, "eos"):
        raise _refuse("stop_token", args.stop_token, "must be `eos` or None")
    if args.kl_estimator not in ("k1", "k3"):
        raise _refuse("kl_estimator", args.kl_estimator, "must be `k1` or `k3`, as in TRL")
    if args.missing_eos_penalty is not None and not args.stop_token and args.stop_token_id is None:
        raise _refuse(
            "missing_eos_penalty",
            args.missing_eos_penalty,
            "needs stop_token `eos` (or a stop_token_id) "
            "in lmppo: the penalty goes to responses that end without the stop token",
        )


def _steps(value: float, total: int) -> int:
    """A TrainingArguments step count: an int, or a fraction of `total` when below 1."""
    return int(value) if value >= 1 else math.ceil(total * value)


def lmppo_config(
    args: PPOConfig,
    *,
    world_size: int,
    num_prompts: int,
    max_prompt_length: int,
    stop_token: str = "none",
    peft_config: Any = None,
) -> Config:
    """lmppo's Config for TRL PPOConfig `args` (fields checked by `check_fields` first); `stop_token` is the
    rollout.stop_token string the trainer derived from stop_token / stop_token_id."""
    check_fields(args)
    c = Config()
    c.output_dir = args.output_dir
    c.overwrite = True  # TRL writes into an existing output_dir without asking
    c.seed = int(args.seed)
    c.device = "cpu" if args.use_cpu else "auto"
    c.precision = "auto" if args.bf16 else "fp32"
    c.deepspeed = args.deepspeed or ""
    local_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
    batch = local_batch * world_size
    episodes = args.total_episodes if args.total_episodes is not None else int(args.num_train_epochs * num_prompts)
    iterations = max(math.ceil(episodes / batch), 1)
    c.total_episodes = iterations * batch
    c.data.field = "input_ids"
    c.data.max_prompt_length = max_prompt_length  # TRL never cuts a prompt
    c.data.long_prompts = "error"
    c.data.shuffle = True
    r = c.rollout
    # TRL samples at temperature + 1e-7 and divides logits by it: the same distribution, to the last bit
    r.batch_size, r.max_new_tokens, r.temperature = batch, args.response_length, float(args.temperature) + 1e-7
    r.stop_token, r.backend = stop_token, "native"
    r.forward_batch_size = args.local_rollout_forward_batch_size
    c.reward.sources = []  # the reward model object is the one source (PPOTrainer)
    if args.missing_eos_penalty is not None:
        c.reward.truncation, c.reward.penalty, c.reward.penalty_mode = (
            "penalty",
            -float(args.missing_eos_penalty),
            "add",
        )
    else:
        c.reward.truncation = "none"
    c.kl.coef, c.kl.controller, c.kl.estimator, c.kl.placement = (
        float(args.kl_coef),
        "fixed",
        args.kl_estimator,
        "reward",
    )
    c.value.mode = "critic"
    c.reference.mode = "frozen"
    p = c.ppo
    p.num_epochs, p.num_minibatches = args.num_ppo_epochs, args.num_mini_batches
    # TRL runs micro-batches of per_device_train_batch_size within each process's minibatch (the last one short when
    # it does not divide); lmppo's loss is the same whatever the split, so the micro-batch is the largest size up to
    # per_device_train_batch_size that divides the minibatch
    local_minibatch = local_batch // args.num_mini_batches
    p.micro_batch_size = max(
        d for d in range(1, min(args.per_device_train_batch_size, local_minibatch) + 1) if local_minibatch % d == 0
    )
    p.learning_rate = float(args.learning_rate)
    schedule = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    p.lr_schedule = SCHEDULES.get(schedule, schedule)
    p.warmup_iterations = _steps(args.warmup_steps, iterations)
    p.weight_decay, p.adam_eps, p.max_grad_norm = (
        float(args.weight_decay),
        float(args.adam_epsilon),
        float(args.max_grad_norm),
    )
    p.clip_range, p.value_clip_range, p.vf_coef = (
        float(args.cliprange),
        float(args.cliprange_value),
        float(args.vf_coef),
    )
    p.gamma, p.lam = float(args.gamma), float(args.lam)
    p.advantage_estimator, p.whiten_advantages, p.entropy_coef, p.target_kl = "gae", True, 0.0, 0.0
    c.log.trackers, c.log.sample_every, c.log.progress = [], 0, False  # report_to goes through HF's callbacks
    save = str(getattr(args.save_strategy, "value", args.save_strategy))
    c.checkpoint.every = _steps(args.save_steps, iterations) if save == "steps" else 0
    c.checkpoint.keep_last = args.save_total_limit or max(iterations, 1)
    if peft_config is not None:
        lora = c.model.lora
        lora.enabled = True
        lora.r = int(getattr(peft_config, "r", lora.r))
        lora.alpha = float(getattr(peft_config, "lora_alpha", lora.alpha))
        lora.dropout = float(getattr(peft_config, "lora_dropout", lora.dropout))
        targets = getattr(peft_config, "target_modules", None)
        if targets:
            lora.target_modules = [targets] if isinstance(targets, str) else sorted(targets)
    return c


# ============================================================================ PPOTrainer


class PolicyAndValueWrapper(nn.Module):
    """What TRL's `trainer.model` is: the policy and the value model side by side (`.policy`, `.value_model`)."""

    def __init__(self, policy: nn.Module, value_model: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_model = value_model


@dataclass
class OnlineTrainerState(TrainerState):
    """TRL's trainer state: TrainerState plus the episode counter."""

    episode: int = 0


class PPOTrainer:
    """TRL 1.12's `PPOTrainer(args, processing_class, model, ref_model, reward_model, train_dataset, value_model,
    data_collator=None, eval_dataset=None, optimizers=(None, None), callbacks=None, peft_config=None)`, trained by
    lmppo (`self.lmppo`, an `lmppo.training.trainer.PPOTrainer`, holds lmppo's own config, metrics and checkpoints)."""

    def __init__(
        self,
        args: PPOConfig,
        processing_class: Any,
        model: nn.Module,
        ref_model: nn.Module | None,
        reward_model: nn.Module,
        train_dataset: Any,
        value_model: nn.Module,
        data_collator: Any = None,
        eval_dataset: Any = None,
        optimizers: tuple = (None, None),
        callbacks: list | None = None,
        peft_config: Any = None,
    ) -> None:
        from accelerate import PartialState
        from transformers import TrainerControl
        from transformers.integrations import get_reporting_integration_callbacks
        from transformers.trainer import DEFAULT_CALLBACKS, DEFAULT_PROGRESS_CALLBACK
        from transformers.trainer_callback import CallbackHandler, ExportableState, PrinterCallback

        if not isinstance(args, TrainingArguments):
            raise LmppoError(f"args must be an lmppo.trl.PPOConfig, got a {type(args).__name__}")
        if train_dataset is None:
            raise ConfigError("train_dataset", None, "is required")
        if ref_model is not None and ref_model is model:
            raise ConfigError(
                "ref_model",
                "the policy model",
                "must not be `model` itself: pass a copy, or None (a "
                "copy of the initial policy; with peft_config, the policy with its adapters off)",
            )
        if data_collator is not None:
            raise ConfigError(
                "data_collator",
                type(data_collator).__name__,
                f"lmppo left-pads the `input_ids` column itself; pass data_collator=None (see {DOCS})",
            )
        if optimizers is not None and any(o is not None for o in optimizers):
            raise ConfigError(
                "optimizers",
                optimizers,
                "lmppo builds its own AdamW and schedule from the PPOConfig; pass (None, None)",
            )
        if value_model is None or reward_model is None:
            raise ConfigError("value_model" if value_model is None else "reward_model", None, "is required, as in TRL")
        self.args = args
        self.processing_class = processing_class
        self.reward_model = reward_model
        self.value_model = value_model
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.data_collator = None
        if peft_config is not None:
            from peft import PeftModel, get_peft_model

            if isinstance(model, PeftModel):
                raise ConfigError(
                    "peft_config",
                    type(peft_config).__name__,
                    "was given with a model that is already "
                    "a PeftModel: merge and unload the adapter first, or pass peft_config=None",
                )
            model = get_peft_model(model, peft_config)
        self.policy_model = model
        self.ref_model = ref_model

        # -- sizes, as TRL computes them (and writes them into args)
        world = PartialState().num_processes
        args.world_size = world
        args.local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
        args.micro_batch_size = args.per_device_train_batch_size * world
        args.batch_size = args.local_batch_size * world
        if args.local_batch_size % args.num_mini_batches:
            raise ConfigError(
                "num_mini_batches",
                args.num_mini_batches,
                f"must divide local_batch_size "
                f"({args.local_batch_size} = per_device_train_batch_size x gradient_accumulation_steps)",
            )
        args.mini_batch_size = args.batch_size // args.num_mini_batches
        args.local_mini_batch_size = args.local_batch_size // args.num_mini_batches
        if args.total_episodes is None:
            args.total_episodes = int(args.num_train_epochs * len(train_dataset))
        args.num_total_batches = math.ceil(args.total_episodes / args.batch_size)

        # -- lmppo's config and trainer, with the objects as given
        records = _input_ids(train_dataset)
        tokenizer = _internal_tokenizer(processing_class, model)
        self.config = lmppo_config(
            args,
            world_size=world,
            num_prompts=len(records),
            max_prompt_length=max(len(r) for r in records),
            stop_token=_stop_token(args, processing_class),
            peft_config=peft_config,
        )
        device = "cpu" if args.use_cpu else str(PartialState().device)
        self.reward_source = ModelSource.from_model(
            reward_model,
            tokenizer,
            name="reward_model",
            ctx=SourceContext(device=device, batch_size=self.config.rollout.forward_batch_size),
        )
        self.lmppo = _Engine(
            self.config,
            policy=model,
            tokenizer=tokenizer,
            prompts=list(records),
            reward_functions=[self.reward_source],
            value_model=value_model,
            ref_model=ref_model,
        )
        self.lmppo.on_iteration = self._after_iteration
        if self.lmppo.config.precision == "bf16":
            self.reward_source.autocast_dtype = torch.bfloat16
        self.accelerator = self.lmppo.accelerator
        self.optimizer, self.lr_scheduler = self.lmppo.optimizer, self.lmppo.scheduler
        self.model = PolicyAndValueWrapper(self.lmppo.policy, value_model)
        self.model.config = self.lmppo.policy.config
        self.is_peft_model = hasattr(self.lmppo.policy, "peft_config")
        if args.num_sample_generations > 0:
            self.sample_generations_freq = max(1, args.num_total_batches // args.num_sample_generations)

        # -- callbacks and state, as TRL sets them up
        callbacks_all = DEFAULT_CALLBACKS + get_reporting_integration_callbacks(args.report_to)
        self.callback_handler = CallbackHandler(
            callbacks_all + list(callbacks or []), self.model, processing_class, self.optimizer, self.lr_scheduler
        )
        self.add_callback(PrinterCallback if args.disable_tqdm else DEFAULT_PROGRESS_CALLBACK)
        self.control = TrainerControl()
        self.state = OnlineTrainerState(
            is_local_process_zero=self.accelerator.is_local_main_process,
            is_world_process_zero=self.accelerator.is_main_process,
            stateful_callbacks=[
                cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)
            ],
        )
        self._start_time = None

    # ------------------------------------------------------------------ TRL's API
    def train(self) -> None:
        """Run every update (ceil(total_episodes / batch_size)); callbacks and `state.log_history` as in TRL."""
        args, state = self.args, self.state
        state.global_step = 0
        state.episode = 0
        state.max_steps = args.num_total_batches
        state.num_train_epochs = args.total_episodes / len(self.train_dataset)
        for name in ("logging_steps", "eval_steps", "save_steps"):
            value = getattr(args, name)
            if value is not None:
                setattr(state, name, math.ceil(state.max_steps * value) if value < 1 else value)
        self.control = self.callback_handler.on_train_begin(args, state, self.control)
        self._start_time = time.time()
        self.lmppo.train()
        self.control = self.callback_handler.on_train_end(args, state, self.control)
        if self.control.should_save:  # a callback asked for it at the end; lmppo's final checkpoint is written
            self.control = self.callback_handler.on_save(args, state, self.control)

    def _after_iteration(self, metrics: dict[str, float]) -> None:
        """One TRL update done: log TRL's metrics, step-end callbacks, saves, sample generations."""
        args, state = self.args, self.state
        state.episode = self.lmppo.episode
        logs = {name: metrics.get(name, float("nan")) for name in TRL_LOG_KEYS}
        logs["eps"] = int(state.episode / max(time.time() - self._start_time, 1e-9))
        logs["val/num_eos_tokens"] = int(round(logs["val/num_eos_tokens"]))
        logs["episode"] = int(state.episode)
        state.epoch = state.episode / len(self.train_dataset)
        state.global_step += 1
        self.log(logs)
        self.control = self.callback_handler.on_step_end(args, state, self.control)
        if self.control.should_save:  # lmppo wrote its checkpoint (checkpoint.every = save_steps)
            self.control = self.callback_handler.on_save(args, state, self.control)
        update = state.global_step
        if args.num_sample_generations > 0 and (update - 1) % self.sample_generations_freq == 0:
            self.generate_completions(sampling=True)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """As transformers' Trainer.log: add `epoch`, append {**logs, "step"} to the history, call on_log."""
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The policy in Hugging Face format (safetensors; a PEFT policy saves its adapter), the tokenizer, and the
        PPOConfig as training_args.json (TRL pickles it to training_args.bin)."""
        output_dir = output_dir or self.args.output_dir
        if not self.accelerator.is_main_process:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.lmppo.policy.save_pretrained(output_dir, safe_serialization=True)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        with open(os.path.join(output_dir, "training_args.json"), "w", encoding="utf-8") as fh:
            fh.write(self.args.to_json_string())

    @torch.no_grad()
    def generate_completions(self, sampling: bool = False) -> list[dict[str, Any]] | None:
        """Near-greedy completions (temperature 0.01, as TRL) of the eval prompts in batches of
        per_device_eval_batch_size (the last partial batch dropped, as TRL), scored by the reward model; prints the
        first 5 rows and returns every row ({"query", "model response", "score"}). `sampling`: the first batch only."""
        if self.eval_dataset is None:
            return None

        engine, tok = self.lmppo, self.lmppo.tokenizer
        prompts = [list(r) for r in _input_ids(self.eval_dataset)]
        size = self.args.per_device_eval_batch_size
        rows: list[dict[str, Any]] = []
        for start in range(0, len(prompts) - size + 1, size):
            batch = prompts[start : start + size]
            ids, mask = left_pad(batch, tok.pad_token_id)
            ids, mask = ids.to(engine.device), mask.to(engine.device)
            seeds = [response_seed(self.config.seed + 1, engine.iteration, start + i) for i in range(len(batch))]
            with engine._autocast():
                resp, resp_mask, _, _ = sample_native(
                    engine.policy,
                    ids,
                    mask,
                    0.01 + 1e-7,
                    self.config.rollout.max_new_tokens,
                    engine.stop_ids,
                    tok.pad_token_id,
                    seeds,
                )
            responses = [r[m].tolist() for r, m in zip(resp.cpu(), resp_mask.cpu())]
            scores = self.reward_source([], [], token_ids=[p + r for p, r in zip(batch, responses)]) if batch else []
            for p, r, s in zip(batch, responses, scores):
                rows.append(
                    {
                        "query": tok.decode(p, skip_special_tokens=True),
                        "model response": tok.decode(r),
                        "score": float(s),
                    }
                )
            if sampling:
                break
        if self.accelerator.is_main_process and rows:
            _print_table(rows[:5])
            if "wandb" in (self.args.report_to or []):
                import wandb

                if wandb.run is not None:
                    wandb.log(
                        {"completions": wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])}
                    )
        return rows

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse("push_to_hub", True, REFUSED_UNLESS_DEFAULT["push_to_hub"])

    # ------------------------------------------------------------------ callbacks and helpers (as transformers')
    def add_callback(self, callback: Any) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: Any) -> Any:
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: Any) -> None:
        self.callback_handler.remove_callback(callback)

    def is_world_process_zero(self) -> bool:
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        return self.accelerator.is_local_main_process

    @property
    def lmppo_history(self) -> list[dict[str, float]]:
        """lmppo's own metrics of every iteration (a superset of TRL's, see docs/metrics.md)."""
        return self.lmppo.history


class _Engine(LmppoTrainer):
    """lmppo's trainer, calling `on_iteration(metrics)` after each iteration's phase 6 (its checkpoint included, so
    TRL's `on_save` callbacks come after the files exist, as in TRL)."""

    on_iteration = None

    def finish_iteration(self, *args: Any, **kwargs: Any) -> None:
        super().finish_iteration(*args, **kwargs)
        if self.on_iteration is not None:
            self.on_iteration(self.history[-1])


def _input_ids(dataset: Any) -> list:
    """The prompt token ids of a TRL dataset: its `input_ids` column (a `datasets.Dataset`, or any sequence of rows
    {"input_ids": [...]}), checked as every lmppo prompt source."""

    if not is_hf_dataset(dataset):
        rows = list(dataset)
        dataset = [r["input_ids"] if isinstance(r, dict) and "input_ids" in r else r for r in rows]
    return list(load_prompt_records(DataConfig(field="input_ids"), dataset))


def _stop_token(args: PPOConfig, tokenizer: Any) -> str:
    """rollout.stop_token for TRL's stop_token / stop_token_id."""
    if args.stop_token == "eos":
        return "eos"
    if args.stop_token_id is None:
        return "none"
    token = tokenizer.convert_ids_to_tokens(int(args.stop_token_id))
    if token is None or tokenizer.convert_tokens_to_ids(token) != int(args.stop_token_id):
        raise _refuse("stop_token_id", args.stop_token_id, "is not a token of this tokenizer that lmppo can name")
    return token


def _internal_tokenizer(tokenizer: Any, model: nn.Module) -> Any:
    """The tokenizer lmppo pads with: the one given, or a copy padding with eos when its pad id is outside the
    policy's embedding table (TRL scripts add a `[PAD]` token the model never learnt; TRL replaces padding by id 0
    before each forward pass, lmppo pads with an id the model has)."""

    rows = hf_model(model).get_input_embeddings().weight.shape[0]
    pad = tokenizer.pad_token_id
    if pad is not None and pad < rows:
        return tokenizer
    if tokenizer.eos_token_id is None or tokenizer.eos_token_id >= rows:
        raise ConfigError(
            "processing_class",
            type(tokenizer).__name__,
            f"pad token id {pad} is outside the policy's "
            f"{rows} embeddings and there is no eos token to pad with instead",
        )
    internal = copy.deepcopy(tokenizer)
    internal.pad_token = internal.eos_token
    return internal


def _print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(show_lines=True)
    for column in rows[0]:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    Console().print(table)


# ============================================================================ TRL's script helpers (1.12 fields)


@dataclass
class ScriptArguments:
    """TRL 1.12's `ScriptArguments` (dataset arguments of its example scripts)."""

    dataset_name: str | None = None
    """Path or name of the dataset to load."""
    dataset_config: str | None = None
    """Dataset configuration name (the `name` argument of `datasets.load_dataset`)."""
    dataset_train_split: str = "train"
    """Dataset split to use for training."""
    dataset_test_split: str = "test"
    """Dataset split to use for evaluation."""
    dataset_streaming: bool = False
    """Whether to stream the dataset (lmppo.trl.PPOTrainer needs a whole `datasets.Dataset`)."""
    ignore_bias_buffers: bool = False
    """Debug argument for distributed training (DDP with LM bias/mask buffers)."""


@dataclass
class ModelConfig:
    """TRL 1.12's `ModelConfig` (model loading and LoRA arguments of its example scripts)."""

    model_name_or_path: str | None = None
    """Model checkpoint for weights initialization."""
    model_revision: str = "main"
    """Specific model version to use (branch name, tag name or commit id)."""
    dtype: str | None = field(default="float32", metadata={"choices": ["auto", "bfloat16", "float16", "float32"]})
    """Load the model under this dtype."""
    attn_implementation: str | None = None
    """Which attention implementation to use."""
    use_peft: bool = False
    """Whether to use PEFT (LoRA) for training."""
    lora_r: int = 16
    """LoRA R value."""
    lora_alpha: int = 32
    """LoRA alpha."""
    lora_dropout: float = 0.05
    """LoRA dropout."""
    lora_target_modules: list[str] | None = None
    """LoRA target modules."""
    lora_target_parameters: list[str] | None = None
    """List of target parameters for LoRA."""
    lora_modules_to_save: list[str] | None = None
    """Model layers to unfreeze and train."""
    lora_task_type: str = "CAUSAL_LM"
    """Task type to pass for LoRA."""
    use_rslora: bool = False
    """Whether to use Rank-Stabilized LoRA (scaling lora_alpha / sqrt(r))."""
    use_dora: bool = False
    """Enable Weight-Decomposed Low-Rank Adaptation (DoRA)."""
    load_in_8bit: bool = False
    """8-bit base model (bitsandbytes); refused by get_quantization_config."""
    load_in_4bit: bool = False
    """4-bit base model (bitsandbytes); refused by get_quantization_config."""
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"choices": ["fp4", "nf4"]})
    """Quantization type."""
    use_bnb_nested_quant: bool = False
    """Whether to use nested quantization."""
    bnb_4bit_quant_storage: str | None = None
    """Quantization storage dtype."""

    def __post_init__(self):
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError("You can't use 8 bit and 4 bit precision at the same time")
        if hasattr(self.lora_target_modules, "__len__") and len(self.lora_target_modules) == 1:
            self.lora_target_modules = self.lora_target_modules[0]


_docs_as_help(ScriptArguments)
_docs_as_help(ModelConfig)


def get_peft_config(model_args: ModelConfig) -> Any:
    """TRL 1.12's get_peft_config: a peft.LoraConfig from the ModelConfig, or None without use_peft."""
    if model_args.use_peft is False:
        return None
    from peft import LoraConfig

    return LoraConfig(
        task_type=model_args.lora_task_type,
        r=model_args.lora_r,
        target_modules=model_args.lora_target_modules,
        target_parameters=model_args.lora_target_parameters,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        bias="none",
        use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
        modules_to_save=model_args.lora_modules_to_save,
    )


def get_quantization_config(model_args: ModelConfig) -> None:
    """None; lmppo does not train quantized (bitsandbytes) base models, so load_in_4bit / load_in_8bit are refused."""
    for name in ("load_in_4bit", "load_in_8bit"):
        if getattr(model_args, name):
            raise ConfigError(name, True, "lmppo does not train quantized (bitsandbytes) models")
    return None


class TrlParser(HfArgumentParser):
    """TRL 1.12's `TrlParser`: HfArgumentParser plus `--config file.yaml` (its values become the defaults, its
    `env` mapping is set in os.environ; command-line flags still win)."""

    def __init__(self, dataclass_types: Any = None, **kwargs: Any):
        if dataclass_types is None:
            dataclass_types = []
        elif isinstance(dataclass_types, type):
            dataclass_types = [dataclass_types]
        for dataclass_type in dataclass_types:
            if "config" in dataclass_type.__dataclass_fields__:
                raise ValueError(
                    f"Dataclass {dataclass_type.__name__} has a field named 'config'; it is reserved "
                    "for the config file path"
                )
        super().__init__(dataclass_types=dataclass_types, **kwargs)

    def parse_args_and_config(
        self,
        args: Any = None,
        return_remaining_strings: bool = False,
        fail_with_unknown_args: bool = True,
        separate_remaining_strings: bool = False,
    ):
        import sys

        import yaml

        args = list(args) if args is not None else sys.argv[1:]
        config_remaining: list[str] = []
        if "--config" in args:
            i = args.index("--config")
            args.pop(i)
            with open(args.pop(i), encoding="utf-8") as fh:
                config = yaml.safe_load(fh)
            if not isinstance(config, dict):
                raise ValueError("the config file must contain a YAML mapping")
            env = config.pop("env", {})
            if not isinstance(env, dict):
                raise ValueError("`env` field should be a dict in the YAML file.")
            for key, value in env.items():
                os.environ[key] = str(value)
            config_remaining = self.set_defaults_with_config(**config)
        output = self.parse_args_into_dataclasses(args=args, return_remaining_strings=return_remaining_strings)
        if return_remaining_strings:
            if separate_remaining_strings:
                return output[:-1] + (config_remaining, output[-1])
            return output[:-1] + (config_remaining + output[-1],)
        if fail_with_unknown_args and config_remaining:
            raise ValueError(f"Unknown arguments from config file: {config_remaining}")
        return output

    def set_defaults_with_config(self, **kwargs: Any) -> list[str]:
        used = set()
        for action in self._actions:
            if action.dest in kwargs:
                action.default, action.required = kwargs[action.dest], False
                used.add(action.dest)
        return [item for key, value in kwargs.items() if key not in used for item in (f"--{key}", str(value))]


__all__ = [
    "PPOConfig",
    "PPOTrainer",
    "ScriptArguments",
    "ModelConfig",
    "TrlParser",
    "get_peft_config",
    "get_quantization_config",
    "lmppo_config",
    "check_fields",
    "TRL_LOG_KEYS",
]
