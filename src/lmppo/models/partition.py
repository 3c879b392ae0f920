"""ZeRO-3 partitioned parameters: whether a model is partitioned, its full weights for a block, a process's shard."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def is_partitioned(module: nn.Module) -> bool:
    """True when ZeRO-3 has partitioned the module's parameters (each process holds only a shard)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def gathered_if_partitioned(module: nn.Module) -> contextlib.AbstractContextManager:
    """For a forward pass of a ZeRO-3-partitioned model outside any engine (before `prepare`): its full weights
    for the block, in every process (a collective: every process must enter it). Else nothing."""
    if not is_partitioned(module):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(module.parameters()))


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This process's shard of a ZeRO-3-partitioned parameter, or the parameter itself."""
    return param.ds_tensor if hasattr(param, "ds_tensor") else param


def real_shard(param: torch.Tensor) -> torch.Tensor:
    """The elements of this process's shard that belong to the parameter, flattened: a ZeRO-3 partition is padded
    to an equal size on every process, and its padding is uninitialised memory (it may hold NaN)."""
    if not hasattr(param, "ds_tensor"):
        return param.reshape(-1)
    shard = param.ds_tensor.reshape(-1)
    rank = torch.distributed.get_rank(group=getattr(param, "ds_process_group", None))
    real = max(0, min(param.ds_numel - rank * shard.numel(), shard.numel()))
    return shard[:real]
