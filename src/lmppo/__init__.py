"""lmppo: PPO for causal language models from a reward signal (RLHF)."""

from lmppo.config.schema import Config, load_config
from lmppo.errors import ConfigError, DataError, LmppoError, RewardError
from lmppo.training.callbacks import Callback

__version__ = "0.1.0"
__all__ = ["Callback", "Config", "ConfigError", "DataError", "LmppoError", "PPOTrainer", "RewardError", "load_config"]


def __getattr__(name: str):
    if name == "PPOTrainer":  # imported lazily: torch/transformers load only when training
        from lmppo.training.trainer import PPOTrainer

        return PPOTrainer
    raise AttributeError(name)
