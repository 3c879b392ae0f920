"""TRL 1.12's configuration classes with their fields, types and defaults: `PPOConfig` (TrainingArguments plus TRL's
base-config overrides plus the PPO fields, built as TRL builds it), and its scripts' `ScriptArguments` and
`ModelConfig`. The docstring under each field is its `--help` text and says what it becomes in lmppo's config."""

import dataclasses
import warnings
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from transformers import TrainingArguments

from lmppo.config import field_docs


@dataclass
class PPOConfig(TrainingArguments):  # type: ignore[explicit-any]  # the __init__ mypy writes repeats TrainingArguments' Any fields
    """TRL 1.12's `PPOConfig`: `transformers.TrainingArguments` with TRL's base-config overrides and the PPO fields.
    The docstring under each field says what it becomes in lmppo's own config (also the `--help` text)."""

    # -- TRL's base-config overrides of TrainingArguments (trl/trainer/base_config.py)
    logging_steps: float = 10
    """Accepted with TRL's meaning for PPO: none. TRL 1.12's PPOTrainer logs every update whatever this is, and so
    does lmppo."""
    gradient_checkpointing: bool = True
    """-> model.gradient_checkpointing (non-reentrant, on the policy and the critic). TRL 1.12's PPOTrainer never
    turned it on, whatever this is: set False for TRL's speed (about a third more compute in the update when on)."""
    bf16: bool | None = None  # type: ignore[assignment]  # TRL's base config: None, then `not fp16` (__post_init__)
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
    """Subtracted from the score of each response with no eos token, as in TRL. With a stop token -> reward.truncation
    `penalty`, penalty = -missing_eos_penalty, penalty_mode `add`; without one, a reward source of its own."""
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
        from lmppo.trl.translate import check_fields, check_resume_folder_exists, resume_folder

        self.bf16 = not self.fp16 if self.bf16 is None else self.bf16  # as TRL's base config
        with warnings.catch_warnings():  # "`gradient_checkpointing` is deprecated": TRL's field name, not the user's
            warnings.simplefilter("ignore", FutureWarning)
            super().__post_init__()
        # refused here, when a script parses its arguments, before it loads any model (PPOTrainer checks again)
        check_fields(self)
        check_resume_folder_exists(self)
        self._resume_folder_seen = resume_folder(self) is not None
        """The folder to resume existed when the arguments were parsed (a later "no such folder" means the script
        removed it)."""


def _docs_as_help(cls: type) -> None:
    """HfArgumentParser reads a field's `help` metadata: make it the docstring written under the field."""
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in docs:
            f.metadata = MappingProxyType({**f.metadata, "help": docs[f.name].replace("%", "%%")})


_docs_as_help(PPOConfig)


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
    trust_remote_code: bool = False
    """Whether to trust remote code when loading a model (read by scripts; lmppo.trl.PPOTrainer takes the objects)."""
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
        targets = self.lora_target_modules
        if isinstance(targets, (list, tuple)) and len(targets) == 1:  # as TRL 1.12: one module by its name
            self.lora_target_modules = targets[0]  # type: ignore[assignment]  # a str where the field says list


_docs_as_help(ScriptArguments)
_docs_as_help(ModelConfig)
