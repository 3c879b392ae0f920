"""Typed reads of a module's parts: peft's LoRA layers and transformers' models keep their weights and sub-layers as
attributes, which `nn.Module.__getattr__` types as `Tensor | Module`; these read one and check its type."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def parameter(module: nn.Module, name: str) -> torch.Tensor:
    """`module.<name>`, a weight (a tensor)."""
    value = getattr(module, name)
    assert isinstance(value, torch.Tensor), f"{type(module).__name__}.{name} is not a tensor"
    return value


def optional_parameter(module: nn.Module, name: str) -> Optional[torch.Tensor]:
    """`module.<name>`, a tensor or None (a bias)."""
    value = getattr(module, name, None)
    assert value is None or isinstance(value, torch.Tensor), f"{type(module).__name__}.{name} is not a tensor"
    return value


def submodule(module: nn.Module, name: str) -> nn.Module:
    """`module.<name>`, a module (a LoRA layer's `base_layer`, a reward model's `score` head)."""
    value = getattr(module, name)
    assert isinstance(value, nn.Module), f"{type(module).__name__}.{name} is not a module"
    return value


def module_dict(module: nn.Module, name: str) -> nn.ModuleDict:
    """`module.<name>`, a ModuleDict by adapter name (a LoRA layer's `lora_A`, `lora_B`, `lora_dropout`)."""
    value = getattr(module, name)
    assert isinstance(value, nn.ModuleDict), f"{type(module).__name__}.{name} is not a ModuleDict"
    return value
