"""Typed reads of a module's parts (`lmppo.models.parts`): each returns the attribute as it is, and an attribute of
another kind is an AssertionError naming the module and the attribute (a wrong layer is never read as a weight)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmppo.models.parts import module_dict, optional_parameter, parameter, submodule


def test_each_read_returns_the_attribute_itself():
    layer = nn.Linear(3, 2, bias=False)
    holder = nn.Module()
    holder.base_layer = layer
    holder.lora_A = nn.ModuleDict({"default": nn.Linear(3, 1)})
    assert parameter(layer, "weight") is layer.weight and parameter(layer, "weight").shape == (2, 3)
    assert optional_parameter(layer, "bias") is None
    assert optional_parameter(holder.lora_A["default"], "bias") is holder.lora_A["default"].bias
    assert submodule(holder, "base_layer") is layer
    assert module_dict(holder, "lora_A") is holder.lora_A


def test_an_attribute_of_another_kind_is_refused_by_name():
    holder = nn.Module()
    holder.base_layer = nn.Linear(3, 2)
    holder.register_buffer("scale", torch.ones(()))
    with pytest.raises(AssertionError, match=r"Module.base_layer is not a tensor"):
        parameter(holder, "base_layer")
    with pytest.raises(AssertionError, match=r"Module.base_layer is not a tensor"):
        optional_parameter(holder, "base_layer")
    with pytest.raises(AssertionError, match=r"Module.scale is not a module"):
        submodule(holder, "scale")
    with pytest.raises(AssertionError, match=r"Module.base_layer is not a ModuleDict"):
        module_dict(holder, "base_layer")
