"""Frozen weights cast to the autocast dtype once, not at every call.

Under autocast a linear layer casts its fp32 weight to bf16 on every call. torch keeps such a cast for the rest of
the autocast region only for weights that require grad, so a frozen weight (a LoRA policy's LM head, tied to the
embeddings) is cast again at every decoding step: on the default job (SmolLM2-135M, LoRA, bf16 on CPU) the LM
head's cast was 20% of the sampler's time. In a pass over a whole batch the cast is small next to the matmuls
(keeping every frozen weight's cast sped the update phase up by 1%: `benchmarks/speed/frozen_casts.py --where all`), so
lmppo keeps casts only where it decodes: the sampling copy (`lmppo.sampling.native.SamplingWeights`).

`FrozenCastLinear` is an `nn.Linear` that keeps one cast of its frozen fp32 weight and reuses it while the weight
is unchanged (same storage, same version counter: any in-place write, such as a checkpoint load, makes a new
cast). The computation is the one autocast makes: the same bf16 weight, the input and bias cast by autocast as
before, so outputs and gradients are bit-identical. A weight that requires grad, a weight that is not fp32, or a
call outside autocast takes nn.Linear's own path. The price is memory: one bf16 copy of each such weight.
"""

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
