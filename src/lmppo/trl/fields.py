"""How each TRL PPOConfig field is treated: translated (MAPPED), without effect in TRL 1.12's PPOTrainer
(NO_EFFECT_IN_TRL), or refused unless at TRL's default (REFUSED_UNLESS_DEFAULT); and the metric names TRL logs."""

from typing import Literal

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

# How every TrainingArguments field is treated. Each field of PPOConfig is in exactly one of: the fields `lmppo_config`
# or the trainer translates (MAPPED), NO_EFFECT_IN_TRL (tests/trl/test_fields.py checks this); REFUSED_UNLESS_DEFAULT
# is part of MAPPED.
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
    "gradient_checkpointing",
    "activation_checkpointing",
    "resume_from_checkpoint",
)
"""Fields `lmppo_config` / the trainer read (translated, or refused for values lmppo cannot honour)."""

IGNORED: dict[str, tuple[str, tuple[str, ...]]] = {
    # TRL 1.12's PPOTrainer never runs Trainer.__init__, an evaluation loop, HF's DataLoader set-up, or Trainer.train:
    # these fields change nothing there, and nothing in lmppo. Group -> (why, fields); `ignored_fields` names the ones
    # set to another value than TRL's default, one line per group.
    "run length": (
        "a PPO run lasts total_episodes (or num_train_epochs x the training set), as in TRL",
        ("max_steps", "auto_find_batch_size", "ignore_data_skip", "restore_callback_states_from_checkpoint"),
    ),
    "evaluation": (
        "there is no evaluation loop: generate_completions() samples the eval_dataset num_sample_generations times",
        (
            "eval_strategy",
            "eval_steps",
            "eval_delay",
            "eval_on_start",
            "prediction_loss_only",
            "eval_do_concat_batches",
            "eval_use_gather_object",
            "eval_accumulation_steps",
            "include_for_metrics",
            "batch_eval_metrics",
            "bf16_full_eval",
            "fp16_full_eval",
            "load_best_model_at_end",
            "metric_for_best_model",
            "greater_is_better",
        ),
    ),
    "logging": (
        "every update is logged",
        (
            "logging_steps",
            "logging_strategy",
            "logging_first_step",
            "log_on_each_node",
            "logging_nan_inf_filter",
            "log_level",
            "log_level_replica",
            "skip_memory_metrics",
        ),
    ),
    "speed and kernels": (
        "lmppo has no torch.compile, Liger or NEFTune option; its gradient checkpointing is always non-reentrant",
        (
            "torch_compile",
            "torch_compile_backend",
            "torch_compile_mode",
            "use_liger_kernel",
            "liger_kernel_config",
            "neftune_noise_alpha",
            "torch_empty_cache_steps",
            "use_cache",
            "activation_checkpointing_kwargs",
            "gradient_checkpointing_kwargs",
        ),
    ),
    "the loss": (
        "the PPO loss is lmppo's (the token mean over each minibatch)",
        ("label_smoothing_factor", "average_tokens_across_devices"),
    ),
    "randomness": ("`seed` seeds everything (shuffling included)", ("data_seed", "full_determinism")),
    "checkpoints": (
        "a checkpoint holds everything exact resume needs, written by the main process",
        ("save_only_model", "save_on_each_node", "enable_jit_checkpoint"),
    ),
    "the Hub": (
        "nothing is uploaded: `lmppo push FOLDER --repo-id ORG/NAME` uploads a saved model",
        ("hub_model_id", "hub_token", "hub_private_repo", "hub_strategy", "hub_always_push", "hub_revision"),
    ),
    "data loading": (
        "the prompts are the train_dataset's input_ids, left-padded by lmppo",
        (
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
        ),
    ),
    "distributed set-up": (
        "the launcher (accelerate launch, torchrun) and the `deepspeed` field set it",
        (
            "ddp_find_unused_parameters",
            "ddp_bucket_cap_mb",
            "ddp_broadcast_buffers",
            "ddp_static_graph",
            "ddp_backend",
            "accelerator_config",
            "parallelism_config",
            "debug",
        ),
    ),
}
"""TrainingArguments / PPOConfig fields without effect in TRL 1.12's PPOTrainer nor in lmppo, by group: accepted with
any value; a value other than TRL's default is named in one warning when the trainer is built."""

NOT_WARNED = (
    # read by scripts (TRL's example scripts pass dataset_num_proc to dataset.map, load models from the paths)
    "do_train",
    "do_eval",
    "do_predict",
    "local_rank",
    "dataset_num_proc",
    "sft_model_path",
    "reward_model_path",
    # act through TrainingArguments itself, identically in TRL and lmppo
    "tf32",
    "ddp_timeout",
)
"""Fields TRL 1.12's PPOTrainer does not read either, set by scripts and launchers or acting through
TrainingArguments itself: accepted with any value, no warning."""

NO_EFFECT_IN_TRL = tuple(name for _, names in IGNORED.values() for name in names) + NOT_WARNED
"""Every field TRL 1.12's PPOTrainer does not read (scripts may): accepted, no effect in lmppo either."""

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

SCHEDULES: dict[str, Literal["constant", "linear", "cosine"]] = {
    "linear": "linear",
    "cosine": "cosine",
    "constant": "constant",
    "constant_with_warmup": "constant",
}
"""TrainingArguments' lr_scheduler_type -> lmppo's ppo.lr_schedule (the others are refused)."""
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")
