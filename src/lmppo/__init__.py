"""lmppo: PPO for causal language models from a reward signal (RLHF)."""

from lmppo.callbacks import Callback
from lmppo.config import Config, load_config
from lmppo.errors import ConfigError, DataError, LmppoError, RewardError

__version__ = "0.1.0"
__all__ = ["Callback", "Config", "ConfigError", "DataError", "LmppoError", "PPOTrainer", "RewardError", "load_config"]


def __getattr__(name: str):
    if name == "PPOTrainer":  # imported lazily: torch/transformers load only when training
        from lmppo.trainer import PPOTrainer

        return PPOTrainer
    raise AttributeError(name)
