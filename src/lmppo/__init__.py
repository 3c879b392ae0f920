"""lmppo: PPO for causal language models from a reward signal (RLHF)."""

import importlib

from lmppo.errors import ConfigError, DataError, LmppoError, RewardError

__version__ = "0.1.0"
__all__ = [
    "Callback",
    "Config",
    "ConfigError",
    "DataError",
    "LmppoError",
    "PPOTrainer",
    "RewardError",
    "RewardModelConfig",
    "RewardModelTrainer",
    "load_config",
    "train_reward_model",
]

_LAZY = {
    "Callback": "lmppo.training.callbacks",
    "Config": "lmppo.config",
    "load_config": "lmppo.config",
    "PPOTrainer": "lmppo.training.trainer",
    "RewardModelConfig": "lmppo.config",
    "RewardModelTrainer": "lmppo.training.reward_model",
    "train_reward_model": "lmppo.training.reward_model",
}
"""Imported on first use: `lmppo --version` needs none of them, and the trainer brings torch and transformers."""


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
