"""Sampling engines behind one interface (lmppo.sampling.engines) and a trainer built from ready components."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS, tiny_llama
from lmppo.config import Config
from lmppo.errors import ConfigError
from lmppo.sampling.engines import (
    SAMPLING_ENGINES,
    HFEngine,
    NativeEngine,
    PromptBatch,
    SamplingEngine,
    VLLMEngine,
    build_sampling_engine,
    engine_class,
    register_sampling_engine,
)
from lmppo.sampling.hf import left_pad
from lmppo.sampling.native import response_seed, sample_native
from lmppo.sampling.settings import Sampling
from lmppo.training.assembly import build_components
from lmppo.training.trainer import PPOTrainer


def small_config(tmp_path) -> Config:
    cfg = Config()
    cfg.output_dir = str(tmp_path / "run")
    cfg.total_episodes = 8
    cfg.rollout.batch_size = 4
    cfg.rollout.max_new_tokens = 5
    cfg.ppo.micro_batch_size = 2
    cfg.log.trackers = []
    return cfg


def test_the_built_in_engines_are_registered_under_their_backend_names():
    assert SAMPLING_ENGINES["native"] is NativeEngine and SAMPLING_ENGINES["hf"] is HFEngine
    assert SAMPLING_ENGINES["vllm"] is VLLMEngine and NativeEngine.name == "native"


def test_a_name_registered_twice_is_refused():
    with pytest.raises(ValueError, match="`native` is already registered"):
        register_sampling_engine("native")(type("Other", (SamplingEngine,), {}))
    assert SAMPLING_ENGINES["native"] is NativeEngine


def test_an_unknown_engine_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError) as err:
        engine_class("beam")
    assert err.value.field == "rollout.backend" and "native" in str(err.value)


def test_the_native_engine_is_lmppos_sampler_with_the_batchs_seeds(tokenizer, tmp_path):
    cfg = small_config(tmp_path)
    model = tiny_llama(tokenizer)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    seeds = [response_seed(cfg.seed, 2, p) for p in range(3)]
    stop = torch.tensor([tokenizer.eos_token_id])
    engine = build_sampling_engine("native", cfg, stop, tokenizer.pad_token_id, accelerator=None)
    got = engine.sample(
        model, PromptBatch(ids=ids, mask=mask, token_lists=prompts, seeds=seeds), Sampling.of(cfg.rollout)
    )
    want = sample_native(
        model, ids, mask, cfg.rollout.temperature, cfg.rollout.max_new_tokens, stop, tokenizer.pad_token_id, seeds
    )
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_trainer_from_ready_components_samples_with_the_engine_handed_in(tokenizer, tmp_path):
    """An engine the registry does not know, passed in with the components: the rollout holds its responses."""
    cfg = small_config(tmp_path)
    calls = []

    class Fixed(SamplingEngine):  # every response: token 5, token 6, then the stop token
        def sample(self, policy, prompts, sampling):
            calls.append(prompts)
            B = prompts.ids.shape[0]
            ids = torch.tensor([[5, 6, int(self.stop_ids[0])]] * B)
            mask = torch.ones_like(ids, dtype=torch.bool)
            return ids, mask, torch.ones(B, dtype=torch.bool), torch.zeros(B, dtype=torch.bool)

    parts = build_components(
        cfg,
        policy=tiny_llama(tokenizer),
        tokenizer=tokenizer,
        prompts=PROMPTS,
        reward_functions=[lambda p, c: [1.0] * len(c)],
    )
    parts.sampling_engines["native"] = Fixed(cfg, parts.stop_ids, tokenizer.pad_token_id, parts.accelerator)
    trainer = PPOTrainer(cfg, components=parts)
    rollout = trainer.collect_rollout()
    assert rollout.response_ids[:, :2].eq(torch.tensor([5, 6])).all() and rollout.terminated.all()
    (batch,) = calls
    assert batch.seeds == [response_seed(cfg.seed, 0, p) for p in range(4)]  # rows of the global batch
    assert [ids for ids in batch.token_lists] == [row[m].tolist() for row, m in zip(batch.ids, batch.mask)]
    history = trainer.train()
    assert len(history) == 2 and len(calls) == 3
