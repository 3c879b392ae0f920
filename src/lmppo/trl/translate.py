"""lmppo's Config for a TRL PPOConfig: the fields checked (`check_fields`), then translated (`lmppo_config`); the
fields set without effect (`ignored_fields`); the run folder to resume (`resume_folder`)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING

from lmppo.config import Config
from lmppo.errors import ConfigError
from lmppo.trl.fields import DOCS, IGNORED, OPTIMIZERS, REFUSED_UNLESS_DEFAULT, SCHEDULES

if TYPE_CHECKING:  # PPOConfig checks itself with this module when built: no import of it at run time
    from peft import PeftConfig
    from transformers import PreTrainedTokenizerBase

    from lmppo.trl.config import PPOConfig


def _default(args: PPOConfig, name: str) -> object:
    f = type(args).__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def output_folder(args: PPOConfig) -> str:
    """`args.output_dir` (TrainingArguments.__post_init__ sets its default, `trainer_output`, for a None)."""
    assert args.output_dir is not None, "TrainingArguments.__post_init__ sets output_dir"
    return args.output_dir


def refuse(name: str, value: object, why: str) -> ConfigError:
    return ConfigError(name, value, f"{why} (TRL PPOConfig field; see {DOCS})")


def check_fields(args: PPOConfig) -> None:
    """ConfigError for the first field set to a value lmppo cannot honour."""
    for name, why in REFUSED_UNLESS_DEFAULT.items():
        value, default = getattr(args, name), _default(args, name)
        if name == "include_num_input_tokens_seen":
            default = "no"  # TrainingArguments turns False into "no"
        if value != default and not (value in (None, {}, "") and default in (None, {}, "")):
            raise refuse(name, value, why)
    schedule = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if schedule not in SCHEDULES:
        raise refuse("lr_scheduler_type", schedule, "lmppo's schedules are " + ", ".join(f"`{s}`" for s in SCHEDULES))
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in OPTIMIZERS:
        raise refuse("optim", optim, "lmppo trains with AdamW (`adamw_torch` or `adamw_torch_fused`)")
    save = str(getattr(args.save_strategy, "value", args.save_strategy))
    if save not in ("no", "steps"):
        raise refuse(
            "save_strategy",
            save,
            "lmppo checkpoints every N iterations (`steps`) or only at the end "
            "(`no`); a PPO run has no epochs or best model",
        )
    if isinstance(args.deepspeed, dict):
        raise refuse("deepspeed", "{...}", "give lmppo a DeepSpeed JSON file path, `zero2` or `zero3`")
    if args.stop_token and args.stop_token_id is not None:
        raise refuse("stop_token_id", args.stop_token_id, "is exclusive with stop_token (TRL refuses both too)")
    if args.stop_token not in (None, "eos"):
        raise refuse("stop_token", args.stop_token, "must be `eos` or None")
    if args.kl_estimator not in ("k1", "k3"):
        raise refuse("kl_estimator", args.kl_estimator, "must be `k1` or `k3`, as in TRL")
    local_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
    if args.num_mini_batches < 1 or local_batch % args.num_mini_batches:
        raise refuse(
            "num_mini_batches",
            args.num_mini_batches,
            f"must divide local_batch_size ({local_batch} = per_device_train_batch_size x gradient_accumulation_steps)",
        )
    resume_folder(args)  # refuses a folder other than output_dir


def ignored_fields(args: PPOConfig) -> list[str]:
    """One line per group of `fields.IGNORED` naming the fields `args` sets to another value than TRL's default
    (`name=value`), then why they change nothing; [] when there are none."""
    default = type(args)(output_dir=args.output_dir, use_cpu=args.use_cpu, bf16=args.bf16, report_to="none")
    lines = []
    for group, (why, names) in IGNORED.items():
        changed = [n for n in names if getattr(args, n) != getattr(default, n)]
        if changed:
            shown = ", ".join(f"{n}={getattr(getattr(args, n), 'value', getattr(args, n))!r}" for n in changed)
            lines.append(f"{group}: {shown} ({why})")
    return lines


def resume_folder(args: PPOConfig) -> str | None:
    """The run folder to continue (`resume_from_checkpoint`: this run's output_dir, or `true`), None for a new run."""
    value = args.resume_from_checkpoint
    if value is None or str(value).strip().lower() in ("", "false"):
        return None
    if str(value).strip().lower() == "true" or os.path.realpath(str(value)) == os.path.realpath(output_folder(args)):
        return output_folder(args)
    raise refuse(
        "resume_from_checkpoint",
        value,
        f"must be this run's output_dir ({args.output_dir}) or `true`: lmppo continues a run folder from its latest "
        "complete checkpoint (run the same script again with --resume_from_checkpoint OUTPUT_DIR)",
    )


REMOVED_BY_SCRIPT = (
    "{folder} held a run when the script's arguments were parsed and was removed before PPOTrainer started "
    "(TRL's example scripts remove output_dir at start: `shutil.rmtree(training_args.output_dir)`); to resume, "
    "guard that line with `if not training_args.resume_from_checkpoint:`"
)
"""Why a resume found no folder that existed when the PPOConfig was built."""


def check_resume_folder_exists(args: PPOConfig) -> None:
    """At PPOConfig time (before a script loads any model): a resume needs its run folder to exist."""
    folder = resume_folder(args)
    if folder is not None and not os.path.isdir(folder):
        raise refuse("resume_from_checkpoint", args.resume_from_checkpoint, f"no such folder: {folder}")


def check_resume_folder_kept(args: PPOConfig, folder_seen: bool) -> None:
    """At PPOTrainer time: the folder to resume is still there; when it existed at PPOConfig time (`folder_seen`)
    and is gone now, the script removed it: say so and what to change."""
    folder = resume_folder(args)
    if folder is None or os.path.isdir(folder):
        return
    why = REMOVED_BY_SCRIPT.format(folder=folder) if folder_seen else f"no such folder: {folder}"
    raise refuse("resume_from_checkpoint", args.resume_from_checkpoint, why)


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
    peft_config: PeftConfig | None = None,
) -> Config:
    """lmppo's Config for TRL PPOConfig `args` (fields checked by `check_fields` first); `stop_token` is the
    rollout.stop_token string the trainer derived from stop_token / stop_token_id."""
    check_fields(args)
    c = Config()
    c.output_dir = output_folder(args)
    c.overwrite = True  # TRL writes into an existing output_dir without asking
    c.seed = int(args.seed)
    c.device = "cpu" if args.use_cpu else "auto"
    c.precision = "auto" if args.bf16 else "fp32"
    c.deepspeed = args.deepspeed if isinstance(args.deepspeed, str) else ""  # a dict is refused (check_fields)
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
    if args.missing_eos_penalty is not None and stop_token != "none":
        c.reward.truncation, c.reward.penalty, c.reward.penalty_mode = (
            "penalty",
            -float(args.missing_eos_penalty),
            "add",
        )
    else:  # without a stop token the penalty is a reward source of its own (`trainer.MissingEosPenalty`), as TRL
        c.reward.truncation = "none"
    c.kl.coef, c.kl.controller, c.kl.estimator, c.kl.placement = (
        float(args.kl_coef),
        "fixed",
        args.kl_estimator,
        "reward",
    )
    c.value.mode = "critic"
    c.reference.mode = "frozen"
    c.model.gradient_checkpointing = bool(args.activation_checkpointing)  # = gradient_checkpointing (TrainingArguments)
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
    p.lr_schedule = SCHEDULES[schedule]  # (check_fields refused the others)
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


def stop_token_name(args: PPOConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    """rollout.stop_token for TRL's stop_token / stop_token_id."""
    if args.stop_token == "eos":
        return "eos"
    if args.stop_token_id is None:
        return "none"
    token = tokenizer.convert_ids_to_tokens(int(args.stop_token_id))
    if not isinstance(token, str) or tokenizer.convert_tokens_to_ids(token) != int(args.stop_token_id):
        raise refuse("stop_token_id", args.stop_token_id, "is not a token of this tokenizer that lmppo can name")
    return token
