"""The distribution strategy's hooks in one process (lmppo.distributed.strategy); two processes and DeepSpeed are
exercised
end to end by tests/test_distributed.py and tests/test_deepspeed.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from accelerate import Accelerator

from lmppo.config import Config
from lmppo.distributed.strategy import Strategy, make_strategy


@pytest.fixture(scope="module")
def strategy():
    return make_strategy(Accelerator(cpu=True), Config())


def test_one_process_without_deepspeed_is_the_plain_strategy(strategy):
    assert type(strategy) is Strategy and strategy.zero is None and strategy.reuses_rollout_forward
    assert strategy.backward_kwargs == {}
    for hook in (strategy.generation, strategy.saving, strategy.full_weights):
        assert isinstance(hook(torch.nn.Linear(1, 1)), contextlib.nullcontext)
    with strategy.sync_gradients(False, torch.nn.Linear(1, 1), None) as stack:
        assert stack is not None  # nothing to hold back with one process
    # checkpoints hold whole tensors, written by lmppo (no engine shards)
    assert not strategy.sharded_checkpoint and strategy.checkpoint_layout() == {}
    with pytest.raises(NotImplementedError):
        strategy.write_shards(torch.nn.Linear(1, 1), "unused")


def test_whitening_uses_the_unbiased_variance_of_the_valid_tokens(strategy):
    """values [1, 2, 3, 4] (+ a masked 100): mean 2.5, unbiased variance 5/3, so (x - 2.5) / 1.2910."""
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 100.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    want = torch.tensor([[-1.1619, -0.3873, 0.3873, 1.1619, 0.0]])
    assert torch.allclose(strategy.whiten(values, mask), want, atol=1e-4)


def test_means_sums_and_maxima_over_one_process_are_the_local_values(strategy):
    assert strategy.process_mean(0.25) == 0.25
    assert strategy.process_sum(torch.tensor(3)) == 3.0
    assert strategy.process_max(torch.tensor(-2.0)) == -2.0
    assert strategy.gather_mean(torch.tensor([1.0, 2.0, 6.0])) == 3.0
    # population std: (1, 3, 0, 4) has mean 2 and variance (1 + 1 + 4 + 4) / 4 = 2.5
    assert strategy.gather_std(torch.tensor([1.0, 3.0, 0.0, 4.0])).item() == pytest.approx(2.5**0.5)
