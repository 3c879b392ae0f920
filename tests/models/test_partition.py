"""ZeRO-3 helpers on models that are not partitioned: the parameters themselves, no gathering (the partitioned side
runs in tests/distributed/test_zero.py with two real processes)."""

import contextlib

import torch
from torch import nn

from lmppo.models.partition import gathered_if_partitioned, is_partitioned, local_shard, real_shard


def test_a_plain_module_is_not_partitioned():
    layer = nn.Linear(3, 2)
    assert not is_partitioned(layer)
    assert isinstance(gathered_if_partitioned(layer), contextlib.nullcontext)
    assert local_shard(layer.weight) is layer.weight
    assert torch.equal(real_shard(layer.weight), layer.weight.reshape(-1))


def test_a_parameter_marked_by_zero3_counts_as_partitioned():
    layer = nn.Linear(3, 2)
    layer.weight.ds_id = 0  # what DeepSpeed ZeRO-3 sets on every parameter it partitions
    layer.weight.ds_tensor = torch.arange(4.0)
    assert is_partitioned(layer)
    assert torch.equal(local_shard(layer.weight), torch.arange(4.0))
