"""The PPO minibatch loop never waits for the device: a count of host synchronisations over the update of a real
iteration of a tiny model finds none per micro-batch (issue 44).

On a GPU each of these calls blocks the host until the device has caught up, and none is allowed inside a
captured or compiled update: `.item`, `.tolist`, `.cpu`, `__bool__`, `__int__`, `__float__`, `nonzero`, indexing
with a boolean mask, and host-to-device copies (`.to(device)` / `torch.as_tensor(..., device=)` called by lmppo;
the libraries' own `.to()` calls are same-device moves on a GPU). On the CPU nothing really waits, so the calls
themselves are counted: where they happen is what a GPU run would pay.
"""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, small_config, tiny_llama
from lmppo.training.metrics import MetricsAccumulator
from lmppo.training.trainer import PPOTrainer
from lmppo.training.update import UpdateBatch

HERE = str(Path(__file__).resolve())
LMPPO = str(Path(__import__("lmppo").__file__).resolve().parent)
READS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "nonzero")


def _call_site(skip_torch: bool = True) -> str:
    """file:line of the first caller outside this file (and outside torch's own Python code when `skip_torch`)."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename == HERE or (skip_torch and "/torch/" in frame.f_code.co_filename)
    ):
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _from_lmppo() -> bool:
    """Whether lmppo itself made the call (a library's `.to()` is a same-device move on a GPU)."""
    return _call_site(skip_torch=False).startswith(LMPPO)


def _is_device(value: object) -> bool:
    return isinstance(value, (torch.device, str)) and str(value).split(":")[0] in ("cpu", "cuda", "mps", "xpu")


class SyncCounter:
    """Host synchronisations by call site, counted while `phase` is set (`during`)."""

    def __init__(self) -> None:
        self.phase = ""
        self.seen: Counter[tuple[str, str, str]] = Counter()  # (phase, what, call site) -> count

    def record(self, what: str) -> None:
        if self.phase:
            self.seen[(self.phase, what, _call_site())] += 1

    def count(self, phase: str) -> int:
        return sum(n for (p, _, _), n in self.seen.items() if p == phase)

    def sites(self, phase: str) -> list[str]:
        return sorted(f"{what} at {site} x{n}" for (p, what, site), n in self.seen.items() if p == phase)

    @contextmanager
    def during(self, phase: str):
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    @contextmanager
    def installed(self):
        originals = {name: getattr(torch.Tensor, name) for name in (*READS, "__getitem__", "to")}
        original_as_tensor, original_tensor = torch.as_tensor, torch.tensor
        counter = self

        def reading(name):
            def wrapper(self, *args, **kwargs):
                counter.record(name)
                return originals[name](self, *args, **kwargs)

            return wrapper

        def getitem(self, index):
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                counter.record("boolean-mask index")
            return originals["__getitem__"](self, index)

        def to(self, *args, **kwargs):
            if (any(_is_device(a) for a in args) or "device" in kwargs) and _from_lmppo():
                counter.record("to(device)")
            return originals["to"](self, *args, **kwargs)

        def creating(original, name):
            def wrapper(data, *args, **kwargs):
                if kwargs.get("device") is not None and not isinstance(data, torch.Tensor) and _from_lmppo():
                    counter.record(f"{name}(host data, device=)")
                return original(data, *args, **kwargs)

            return wrapper

        try:
            for name in READS:
                setattr(torch.Tensor, name, reading(name))
            torch.Tensor.__getitem__ = getitem  # type: ignore[method-assign]
            torch.Tensor.to = to  # type: ignore[method-assign]
            torch.as_tensor, torch.tensor = (
                creating(original_as_tensor, "as_tensor"),
                creating(original_tensor, "tensor"),
            )
            yield self
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)
            torch.as_tensor, torch.tensor = original_as_tensor, original_tensor


def update_syncs(tmp_path, tokenizer, micro_batch_size: int, **fields) -> SyncCounter:
    """Collect, score and compute advantages of one real iteration, then count the syncs of its PPO update:
    phase `micro-batch` inside each micro-batch's loss and backward, `update` over the whole `Updater.update`."""
    cfg = small_config(tmp_path / f"run{micro_batch_size}", 1, 8, ppo__micro_batch_size=micro_batch_size, **fields)
    trainer = PPOTrainer(
        cfg,
        policy=tiny_llama(tokenizer),
        tokenizer=tokenizer,
        prompts=PROMPTS,
        reward_functions=[lambda prompts, completions: [len(c) / 20.0 for c in completions]],
    )
    rollout = trainer.collect_rollout()
    rewards = trainer.token_rewards(rollout, trainer.score(rollout))
    advantages, returns = trainer.advantages(rollout, rewards)
    counter = SyncCounter()
    loss, backward = trainer.updater.micro_batch_loss, trainer.accelerator.backward

    def counted_loss(*args, **kwargs):
        with counter.during("micro-batch"):
            return loss(*args, **kwargs)

    def counted_backward(*args, **kwargs):
        with counter.during("micro-batch"):
            return backward(*args, **kwargs)

    trainer.updater.micro_batch_loss, trainer.accelerator.backward = counted_loss, counted_backward
    with counter.installed(), counter.during("update"):
        trainer.updater.update(UpdateBatch(rollout, advantages, returns, rewards.train_mask), MetricsAccumulator())
    return counter


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"value__mode": "critic"},
        {"kl__placement": "both", "ppo__max_grad_norm": 0.0},
        {"model__attn_implementation": "sdpa", "value__mode": "critic"},  # transformers' SDPA mask: no padding check
    ],
    ids=["shared", "critic", "kl-loss-no-clip", "sdpa"],
)
def test_no_host_sync_per_micro_batch(tmp_path, tokenizer, fields):
    # 2 epochs x 2 minibatches of 4 rows: 4 micro-batches of 4 rows, or 16 of 1 row
    few, many = (update_syncs(tmp_path, tokenizer, micro, **fields) for micro in (4, 1))
    assert few.count("micro-batch") == 0, few.sites("micro-batch")
    assert many.count("micro-batch") == 0, many.sites("micro-batch")
    # whatever sits between the micro-batches: the whole update costs the same with 4x the micro-batches
    assert many.count("update") == few.count("update"), (few.sites("update"), many.sites("update"))
    # and what it does cost is per iteration or per epoch: the row widths, the epoch orders and index copies,
    # the non-finite check
    assert few.count("update") <= 8, few.sites("update")


def test_the_counter_sees_each_kind_of_sync():
    counter = SyncCounter()
    x = torch.arange(4.0)
    with counter.installed(), counter.during("p"):
        x.sum().item()
        x.tolist()
        bool(x[0])
        int(x[1])
        float(x[2])
        x.nonzero()
        x[x > 1]
        x.cpu()
    kinds = {what for (_, what, _) in counter.seen}
    assert kinds == {"item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "boolean-mask index", "cpu"}
