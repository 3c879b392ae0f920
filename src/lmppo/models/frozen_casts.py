"""Frozen weights cast to the autocast dtype once, not at every call.

Design notes: docs/design.md, `lmppo.models.frozen_casts`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FrozenCastLinear(nn.Linear):
    """nn.Linear that reuses one autocast-dtype copy of its frozen fp32 weight (see the module docstring)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        device = weight.device.type
        if weight.requires_grad or weight.dtype != torch.float32 or not torch.is_autocast_enabled(device):
            return F.linear(input, weight, self.bias)
        return F.linear(input, self._cast(weight, torch.get_autocast_dtype(device)), self.bias)

    def _cast(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (dtype, weight.data_ptr(), weight._version)
        cached = self.__dict__.get("_frozen_cast")
        if cached is None or cached[0] != key:
            # a normal tensor even when first made under inference_mode: a later pass with grad saves it
            with torch.inference_mode(False), torch.no_grad():
                cached = (key, weight.detach().to(dtype))
            self.__dict__["_frozen_cast"] = cached
        return cached[1]

    def __getstate__(self) -> dict:
        """Copies and pickles leave the cast behind (a copy makes its own when it first runs)."""
        state = self.__dict__.copy()
        state.pop("_frozen_cast", None)
        return state


def reuse_frozen_casts(model: nn.Module, enabled: bool = True) -> int:
    """Make every plain nn.Linear of `model` whose weight is frozen and fp32 a FrozenCastLinear (or, `enabled=False`,
    every
    FrozenCastLinear back to nn.Linear, its cast dropped). Parameters, state-dict keys and `isinstance(m,
    nn.Linear)` are unchanged. Returns how many layers were switched."""
    switched = 0
    for module in model.modules():
        if (
            enabled
            and type(module) is nn.Linear
            and not module.weight.requires_grad
            and module.weight.dtype == torch.float32
        ):
            module.__class__ = FrozenCastLinear
            switched += 1
        elif not enabled and type(module) is FrozenCastLinear:
            module.__dict__.pop("_frozen_cast", None)
            module.__class__ = nn.Linear
            switched += 1
    return switched
