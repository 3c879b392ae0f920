"""A drop-in for TRL 1.12's PPO: `from lmppo.trl import PPOConfig, PPOTrainer` (docs/migrating_from_trl.md)."""

from lmppo.trl.drop_in import (
    TRL_LOG_KEYS,
    ModelConfig,
    PPOConfig,
    PPOTrainer,
    ScriptArguments,
    TrlParser,
    check_fields,
    get_peft_config,
    get_quantization_config,
    lmppo_config,
)

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
