"""TRL 1.12's script helpers: `TrlParser` (HfArgumentParser plus `--config file.yaml`), `get_peft_config`,
`get_quantization_config` and `get_kbit_device_map`, so a script's `from trl import ...` line can point at lmppo.trl
when TRL is not installed."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Iterable, Sequence

from transformers import HfArgumentParser
from transformers.hf_argparser import DataClassType

from lmppo.errors import ConfigError
from lmppo.trl.config import ModelConfig

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
    from peft import LoraConfig


def get_peft_config(model_args: ModelConfig) -> LoraConfig | None:
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


def get_kbit_device_map() -> dict[str, int] | None:
    """TRL 1.12's get_kbit_device_map: this process's device for a quantized model (scripts call it only when
    get_quantization_config returned a config, which lmppo's never does)."""
    import torch
    from accelerate import PartialState

    return {"": PartialState().local_process_index} if torch.cuda.is_available() else None


def get_quantization_config(model_args: ModelConfig) -> None:
    """None; lmppo does not train quantized (bitsandbytes) base models, so load_in_4bit / load_in_8bit are refused."""
    for name in ("load_in_4bit", "load_in_8bit"):
        if getattr(model_args, name):
            raise ConfigError(name, True, "lmppo does not train quantized (bitsandbytes) models")
    return None


class TrlParser(HfArgumentParser):
    """TRL 1.12's `TrlParser`: HfArgumentParser plus `--config file.yaml` (its values become the defaults, its
    `env` mapping is set in os.environ; command-line flags still win)."""

    def __init__(
        self,
        dataclass_types: type[DataclassInstance] | Iterable[type[DataclassInstance]] | None = None,
        **kwargs: object,
    ):
        if dataclass_types is None:
            types = []
        elif isinstance(dataclass_types, type):
            types = [dataclass_types]
        else:
            types = list(dataclass_types)
        for dataclass_type in types:
            if "config" in {f.name for f in dataclasses.fields(dataclass_type)}:
                raise ValueError(
                    f"Dataclass {dataclass_type.__name__} has a field named 'config'; it is reserved "
                    "for the config file path"
                )
        super().__init__(dataclass_types=[DataClassType(t) for t in types], **kwargs)

    def parse_args_and_config(
        self,
        args: Sequence[str] | None = None,
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

    def set_defaults_with_config(self, **kwargs: object) -> list[str]:
        used = set()
        for action in self._actions:
            if action.dest in kwargs:
                action.default, action.required = kwargs[action.dest], False
                used.add(action.dest)
        return [item for key, value in kwargs.items() if key not in used for item in (f"--{key}", str(value))]
