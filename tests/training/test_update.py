"""The PPO update's pieces without a model: minibatch order, micro-batch widths, the loss's KL estimator, the
target-KL brake and the non-finite guard of an optimizer step."""

from __future__ import annotations

import pytest
import torch

from conftest import hand_rollout
from lmppo.config import Config
from lmppo.core.objective import STAT_NAMES
from lmppo.errors import TrainingError
from lmppo.training.batch import Rollout
from lmppo.training.metrics import MetricsAccumulator
from lmppo.training.update import (
    MEAN_STATS,
    NonfiniteGuard,
    RowWidths,
    UpdateBatch,
    epoch_orders,
    loss_kl_estimator,
    row_widths,
    trim,
    went_too_far,
)


def test_epoch_orders_cover_the_batch_once_per_epoch_in_a_fresh_order():
    got = list(epoch_orders(3, 8, torch.Generator().manual_seed(0)))
    assert [epoch for epoch, _ in got] == [0, 1, 2]
    orders = [order for _, order in got]
    assert all(isinstance(order, list) and sorted(order) == list(range(8)) for order in orders)
    assert orders[0] != orders[1]
    expected = torch.randperm(8, generator=torch.Generator().manual_seed(0)).tolist()  # the generator's draws
    assert orders[0] == expected


def _rollout() -> Rollout:
    """3 rows, 4 prompt columns (left-padded: 2, 4 and 0 real tokens), 5 response columns (3, 1 and 5 real)."""
    prompt_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    response_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    values = torch.arange(15.0).reshape(3, 5)
    return hand_rollout(
        prompt_ids=torch.arange(12).reshape(3, 4),
        prompt_mask=prompt_mask,
        response_ids=torch.arange(15).reshape(3, 5),
        response_mask=response_mask,
        logprobs=-values,
        ref_logprobs=-2 * values,
        values=values,
        final_values=torch.zeros(3),
        terminated=torch.ones(3, dtype=torch.bool),
        truncated=torch.zeros(3, dtype=torch.bool),
        group_ids=torch.arange(3),
        prompts_text=["a", "b", "c"],
        responses_text=["x", "y", "z"],
    )


def test_row_widths_give_each_micro_batch_the_widths_trim_reads_from_the_device():
    rollout = _rollout()
    widths = row_widths(rollout)
    assert widths == RowWidths(4, 5, [2, 0, 0], [2, 4, 0], [3, 1, 5])
    # row 0 alone: prompt from column 2, 3 response columns, no padding left; rows 0, 1: prompt from 0, padded
    for rows, expected in (([0], (2, 3, False)), ([1], (0, 1, False)), ([0, 1], (0, 3, True)), ([2], (0, 5, True))):
        got = widths.micro_batch(rows)
        assert (got.first_prompt_column, got.response_width, got.padded) == expected
        host, _ = trim(rollout.select(rows), got)
        device, _ = trim(rollout.select(rows))  # read from the tensors
        assert torch.equal(host.input_ids, device.input_ids) and torch.equal(host.values, device.values)


def test_buckets_round_both_widths_up_to_a_few_fixed_ones():
    widths = RowWidths(8, 8, [5, 6], [3, 2], [3, 1])
    exact = widths.micro_batch([0, 1])
    assert (exact.first_prompt_column, exact.response_width, exact.padded) == (5, 3, True)
    bucketed = widths.micro_batch([0, 1], buckets=4)  # widths in steps of 2: prompt 3 -> 4 columns, response 3 -> 4
    assert (bucketed.first_prompt_column, bucketed.response_width, bucketed.padded) == (4, 4, True)
    assert widths.micro_batch([0], buckets=4).padded  # a column of padding added on either side
    assert RowWidths(8, 8, [6], [2], [8]).micro_batch([0], buckets=4).padded is False  # 2 and 8 are buckets


def test_update_batch_gathers_once_per_epoch_and_slices_micro_batches():
    rollout = _rollout()
    whole = UpdateBatch(rollout, rollout.values + 100, rollout.values + 200, rollout.response_mask)
    shuffled = whole.shuffled([2, 0, 1])
    assert shuffled.index.tolist() == [2, 0, 1] and shuffled.rollout.episodes.prompts.texts == ["c", "a", "b"]
    part = shuffled.rows(1, 3)
    assert part.index.tolist() == [0, 1] and part.rollout.episodes.side.texts == ["x", "y"]
    assert torch.equal(part.advantages, rollout.values[[0, 1]] + 100)
    assert torch.equal(part.rollout.response_mask, rollout.response_mask[[0, 1]])


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


def _parameter_with_fused_adamw(fused: bool) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    return weight, torch.optim.AdamW([weight], lr=0.1, weight_decay=0.0, fused=fused)


@pytest.mark.parametrize("fused", [True, False])
def test_a_non_finite_step_is_skipped_counted_and_stops_the_run_at_the_limit(fused):
    weight, opt = _parameter_with_fused_adamw(fused)
    guard, stats = NonfiniteGuard(opt, 1, 3, torch.device("cpu")), MetricsAccumulator()
    assert guard.on_device is fused  # the fused kernel skips on the device; the per-tensor one reads the flag

    def step(grad: float, loss: float) -> None:
        weight.grad = torch.full((2,), grad)
        guard.step(lambda: torch.linalg.vector_norm(weight.grad), torch.tensor(loss), stats)

    step(1.0, 1.0)  # finite: AdamW's first step moves each weight by lr against the gradient's sign
    assert torch.allclose(weight.detach(), torch.tensor([0.9, -2.1])) and weight.grad is None
    after_first = weight.detach().clone()
    step(float("inf"), 1.0)
    step(1.0, float("nan"))
    assert torch.equal(weight.detach(), after_first) and opt.state[weight]["step"].item() == 1  # nothing moved
    assert stats.count("update/skipped_nonfinite") == 3 and stats.mean("update/skipped_nonfinite") == pytest.approx(
        2 / 3
    )
    assert stats.mean("policy/grad_norm") == pytest.approx(2**0.5)  # the finite step's norm only
    assert guard.check() == 2  # the streak so far, below the limit
    step(float("nan"), 1.0)
    with pytest.raises(TrainingError, match="3 updates in a row"):
        guard.check()


def test_the_streak_starts_from_the_previous_iterations_and_ends_at_a_finite_step():
    weight, opt = _parameter_with_fused_adamw(True)
    guard, stats = NonfiniteGuard(opt, 2, 3, torch.device("cpu")), MetricsAccumulator()
    weight.grad = torch.ones(2)
    guard.step(lambda: torch.tensor(1.0), torch.tensor(1.0), stats)
    assert guard.check() == 0 and "policy/grad_norm" in stats
    other = NonfiniteGuard(opt, 2, 3, torch.device("cpu"))
    weight.grad = torch.ones(2)
    other.step(lambda: torch.tensor(float("nan")), torch.tensor(1.0), MetricsAccumulator())
    with pytest.raises(TrainingError):
        other.check()


def test_the_reported_update_statistics_are_the_objectives_and_the_gradient_norm():
    """One list of the loss statistics (`STAT_NAMES`): a new one is reported without a second list to edit."""
    assert MEAN_STATS == (*STAT_NAMES.values(), "policy/grad_norm")
