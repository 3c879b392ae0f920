"""The run's configuration: the schema (sections and fields), validation, dotted overrides, YAML input.

Everything a caller needs is importable from here (`from lmppo.config import Config, load_config`)."""

from lmppo.config.env import RESERVED_HEADERS, expand_env, expand_path, http_headers
from lmppo.config.fields import config_error, field_docs, from_dict
from lmppo.config.loading import config_file, load_config, load_root, recipe_path, save_config
from lmppo.config.model_names import BUILTIN_MODELS, check_model_path, hub_repo_id, is_hub_repo_id
from lmppo.config.overrides import all_fields, apply_override, parse_overrides
from lmppo.config.reward_model import RewardModelConfig
from lmppo.config.sampling_settings import check_generation_kwargs
from lmppo.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    EnvironmentConfig,
    KLConfig,
    LogConfig,
    LoraConfig,
    ModelConfig,
    PPOConfig,
    ReferenceConfig,
    RewardConfig,
    RewardSourceConfig,
    RolloutConfig,
    ValueConfig,
    default_sources,
)
from lmppo.config.validation import FLOAT_RANGES

__all__ = [
    "BUILTIN_MODELS",
    "FLOAT_RANGES",
    "RESERVED_HEADERS",
    "CheckpointConfig",
    "EnvironmentConfig",
    "Config",
    "DataConfig",
    "KLConfig",
    "LogConfig",
    "LoraConfig",
    "ModelConfig",
    "PPOConfig",
    "ReferenceConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RewardSourceConfig",
    "RolloutConfig",
    "ValueConfig",
    "all_fields",
    "apply_override",
    "check_generation_kwargs",
    "check_model_path",
    "config_error",
    "default_sources",
    "expand_env",
    "expand_path",
    "field_docs",
    "from_dict",
    "http_headers",
    "hub_repo_id",
    "is_hub_repo_id",
    "load_config",
    "load_root",
    "parse_overrides",
    "recipe_path",
    "config_file",
    "save_config",
]
