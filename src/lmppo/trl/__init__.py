"""A drop-in for TRL 1.12's PPO: ``from lmppo.trl import PPOConfig, PPOTrainer`` replaces
``from trl.experimental.ppo import PPOConfig, PPOTrainer`` (TRL removed its PPOTrainer after 1.12).

These names are TRL's: ``lmppo.trl.PPOConfig`` is TRL's config class (not lmppo's ``lmppo.Config``),
``lmppo.trl.PPOTrainer`` takes TRL's constructor arguments (lmppo's own trainer is ``lmppo.PPOTrainer``, i.e.
``lmppo.training.trainer.PPOTrainer``, which takes an ``lmppo.Config``), ``lmppo.trl.ModelConfig`` is TRL's script
argument class (lmppo's model section is ``lmppo.config.ModelConfig``).

- ``config``: TRL's ``PPOConfig``, ``ScriptArguments``, ``ModelConfig`` (fields, types and defaults of TRL 1.12)
- ``fields``: how each PPOConfig field is treated (translated, without effect, refused unless default)
- ``translate``: the checks and the translation to lmppo's ``Config``
- ``trainer``: TRL's ``PPOTrainer`` on lmppo's trainer
- ``scripts``: ``TrlParser``, ``get_peft_config``, ``get_quantization_config``, ``get_kbit_device_map``

How lmppo departs from TRL, field by field: docs/migrating_from_trl.md. The main ones: the score sits on the stop
token (TRL puts it one past it); ``max_grad_norm`` is applied (TRL 1.12 never clips); with gradient accumulation the
loss is the token mean over the whole minibatch (TRL averages micro-batch means); prompts are always left-padded; the
random streams differ, so one seed does not give TRL's samples.
"""

from lmppo.trl.config import ModelConfig, PPOConfig, ScriptArguments
from lmppo.trl.fields import TRL_LOG_KEYS
from lmppo.trl.scripts import TrlParser, get_kbit_device_map, get_peft_config, get_quantization_config
from lmppo.trl.trainer import PPOTrainer
from lmppo.trl.translate import check_fields, lmppo_config

__all__ = [
    "PPOConfig",
    "PPOTrainer",
    "ScriptArguments",
    "ModelConfig",
    "TrlParser",
    "get_peft_config",
    "get_quantization_config",
    "get_kbit_device_map",
    "lmppo_config",
    "check_fields",
    "TRL_LOG_KEYS",
]
