"""The PPO update's pieces without a model: minibatch order, the loss's KL estimator, the target-KL brake and the
non-finite guard of an optimizer step."""

from __future__ import annotations

import pytest
import torch

from lmppo.config import Config
from lmppo.core.objective import STAT_NAMES
from lmppo.errors import TrainingError
from lmppo.training.metrics import MetricsAccumulator
from lmppo.training.update import MEAN_STATS, checked_step, loss_kl_estimator, minibatches, went_too_far


def test_minibatches_cover_the_batch_once_per_epoch_in_a_fresh_order():
    got = list(minibatches(3, 8, 4, torch.Generator().manual_seed(0), "cpu"))
    assert [epoch for epoch, _ in got] == [0, 0, 1, 1, 2, 2]
    orders = [torch.cat([idx for e, idx in got if e == epoch]).tolist() for epoch in range(3)]
    assert all(sorted(order) == list(range(8)) for order in orders)
    assert orders[0] != orders[1]
    expected = torch.randperm(8, generator=torch.Generator().manual_seed(0)).tolist()  # the generator's draws
    assert orders[0] == expected


def test_the_loss_kl_term_follows_estimator_and_placement():
    cfg = Config()
    cfg.kl.placement = "reward"
    assert loss_kl_estimator(cfg) is None
    for placement in ("loss", "both"):
        cfg.kl.placement = placement
        assert loss_kl_estimator(cfg) == "k3"  # whatever kl.estimator (k1 here) says for the rewards
    cfg.kl.loss_estimator = "k2"
    assert loss_kl_estimator(cfg) == "k2"
    cfg.kl.placement, cfg.kl.estimator = "reward", "exact"
    assert loss_kl_estimator(cfg) == "exact"


class Strategy:
    def process_mean(self, value: float) -> float:
        return value


def test_target_kl_brake():
    stats = MetricsAccumulator()
    for v in (0.5, 0.0, 0.02, 0.04):  # approx KL of the last 3 micro-batches: mean 0.02
        stats.add("policy/approxkl_avg", v)
    assert not went_too_far(stats, 3, 0.0, Strategy()) and "ppo/updates" not in stats  # off: no metric
    assert not went_too_far(stats, 3, 0.014, Strategy())  # 0.02 <= 1.5 * 0.014 = 0.021
    assert went_too_far(stats, 3, 0.013, Strategy())  # 0.02 > 0.0195
    assert stats.count("ppo/updates") == 2 and stats.max("ppo/early_stop") == 1.0


class Optimizer:
    def __init__(self) -> None:
        self.steps, self.zeroed = 0, 0

    def step(self) -> None:
        self.steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zeroed += 1


def test_a_non_finite_step_is_skipped_counted_and_stops_the_run_at_the_limit():
    opt, stats = Optimizer(), MetricsAccumulator()
    assert checked_step(opt, lambda: torch.tensor(2.0), torch.tensor(1.0), stats, 1, 3) == 0  # the streak ends
    assert (opt.steps, opt.zeroed, stats.mean("policy/grad_norm")) == (1, 1, 2.0)
    assert checked_step(opt, lambda: torch.tensor(float("inf")), torch.tensor(1.0), stats, 0, 3) == 1
    assert checked_step(opt, lambda: 1.0, torch.tensor(float("nan")), stats, 1, 3) == 2
    assert opt.steps == 1 and stats.count("update/skipped_nonfinite") == 3
    with pytest.raises(TrainingError, match="3 updates in a row"):
        checked_step(opt, lambda: 1.0, torch.tensor(float("nan")), stats, 2, 3)


def test_the_reported_update_statistics_are_the_objectives_and_the_gradient_norm():
    """One list of the loss statistics (`STAT_NAMES`): a new one is reported without a second list to edit."""
    assert MEAN_STATS == (*STAT_NAMES.values(), "policy/grad_norm")
