"""lmppo.training.compiled_update (`ppo.compile`): when it compiles, that the compiled update computes what the eager
one does (inductor on the CPU: the same code path as CUDA's but for CUDA graphs), and that a compiler failure
leaves a run training eagerly after one warning."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS, small_config, tiny_llama
from lmppo.training.compiled_update import compiles
from lmppo.training.metrics import MetricsAccumulator
from lmppo.training.trainer import PPOTrainer
from lmppo.training.update import UpdateBatch


def test_auto_compiles_on_cuda_only_and_on_off_are_obeyed():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert (compiles("auto", cpu), compiles("auto", cuda)) == (False, True)
    assert (compiles("on", cpu), compiles("off", cuda)) == (True, False)


def _trainer(tmp_path, tokenizer, name: str, **fields) -> PPOTrainer:
    cfg = small_config(tmp_path / name, 1, 8, **fields)
    reward = [lambda prompts, completions: [len(c) / 20.0 for c in completions]]
    return PPOTrainer(cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=PROMPTS, reward_functions=reward)


def test_the_eager_default_on_a_cpu_builds_nothing(tmp_path, tokenizer):
    assert _trainer(tmp_path, tokenizer, "auto").updater.compiled is None
    assert _trainer(tmp_path, tokenizer, "on", ppo__compile="on").updater.compiled is not None


class Batch:
    """One iteration's rollout, rewards and advantages from `source`, before any update."""

    def __init__(self, source: PPOTrainer):
        torch.manual_seed(1)
        self.rollout = source.collect_rollout()
        self.rewards = source.token_rewards(self.rollout, source.score(self.rollout))
        self.advantages, self.returns = source.advantages(self.rollout, self.rewards)

    def update(self, trainer: PPOTrainer) -> dict[str, float]:
        """`trainer`'s PPO update on this batch -> its statistics' means."""
        stats = MetricsAccumulator()
        trainer.updater.update(UpdateBatch(self.rollout, self.advantages, self.returns, self.rewards.train_mask), stats)
        return stats.means()


@pytest.mark.slow
@pytest.mark.parametrize(
    "value_mode, aggregation", [("shared", "token_mean"), ("critic", "token_mean"), ("shared", "sequence_mean")]
)
def test_the_compiled_update_equals_the_eager_one(tmp_path, tokenizer, value_mode, aggregation):
    torch.manual_seed(0)
    fields = {"value__mode": value_mode, "ppo__loss_aggregation": aggregation}
    eager = _trainer(tmp_path, tokenizer, "eager", **fields, ppo__compile="off")
    compiled = _trainer(tmp_path, tokenizer, "compiled", **fields, ppo__compile="on")
    before = {name: weight.clone() for name, weight in _weights(eager).items()}
    batch = Batch(eager)  # sampled by the initial weights, which both trainers share
    eager_stats, compiled_stats = batch.update(eager), batch.update(compiled)
    assert compiled.updater.compiled is not None and not compiled.updater.compiled.failure
    assert compiled.updater.compiled.compiled_calls == 4  # 2 epochs x 2 minibatches of one micro-batch, all compiled
    assert compiled.updater.compiled.take_seconds() > 0  # the first call of each shape, timed
    assert compiled_stats.keys() == eager_stats.keys()
    for name, value in eager_stats.items():
        assert compiled_stats[name] == pytest.approx(value, abs=1e-5), name
    for name, weight in _weights(eager).items():
        assert torch.allclose(_weights(compiled)[name], weight, atol=1e-5, rtol=0), name
    assert any(not torch.equal(weight, before[name]) for name, weight in _weights(eager).items())


def _weights(trainer: PPOTrainer) -> dict[str, torch.Tensor]:
    critic = {} if trainer.critic is None else {f"critic.{k}": v for k, v in trainer.critic.named_parameters()}
    return {k: v.detach() for k, v in (dict(trainer.actor.named_parameters()) | critic).items()}


@pytest.mark.slow
def test_a_compiler_failure_warns_once_and_the_update_runs_eagerly(tmp_path, tokenizer, monkeypatch):
    """A real failure: inductor is given a C++ compiler that does not exist."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", (str(tmp_path / "no-such-compiler"),))
    torch._dynamo.reset()
    compiled = _trainer(tmp_path, tokenizer, "compiled", ppo__compile="on")
    eager = _trainer(tmp_path, tokenizer, "eager", ppo__compile="off")
    batch = Batch(eager)
    with pytest.warns(UserWarning, match=r"ppo.compile: compiling the update failed .*; it runs eagerly") as seen:
        compiled_stats = batch.update(compiled)
    assert len([w for w in seen if "ppo.compile" in str(w.message)]) == 1
    assert (
        compiled.updater.compiled is not None
        and compiled.updater.compiled.failure
        and compiled.updater.compiled.compiled_calls == 0
    )
    eager_stats = batch.update(eager)
    for name, value in eager_stats.items():  # the eager path after the failure (widths still rounded up)
        assert compiled_stats[name] == pytest.approx(value, abs=1e-5), name
    torch._dynamo.reset()
