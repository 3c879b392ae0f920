"""The run's road from its config (`lmppo.environments.road.run_road`): its producer, its sources (the
environment's reward as the source `environment`), and the sampling settings a call passes."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from conftest import PROMPTS, small_config, tiny_llama
from lmppo.environments.episodes import MultiTurn
from lmppo.environments.road import run_road
from lmppo.episodes.road import EnvironmentReward, EpisodePrompts, SingleTurn
from lmppo.rewards import FunctionSource
from lmppo.sampling.engines import NativeEngine, OneProcess, PromptBatch
from lmppo.sampling.hf import left_pad
from lmppo.sampling.settings import Sampling


def _road(tmp_path, tokenizer, stop_id=None, **fields):
    cfg = small_config(tmp_path, **fields)
    stop = torch.tensor([len(tokenizer) + 1 if stop_id is None else stop_id])  # default never sampled
    engine = NativeEngine(cfg, stop, tokenizer.pad_token_id, OneProcess(torch.device("cpu")))
    source = FunctionSource.from_callable(lambda p, c: [1.0] * len(c), name="one")
    return cfg, run_road(cfg, engine, tokenizer, stop.tolist(), [source], nullcontext)


def test_a_run_without_an_environment_samples_single_responses_with_its_sources(tmp_path, tokenizer):
    cfg, road = _road(tmp_path, tokenizer, rollout__temperature=0.9, rollout__max_new_tokens=7)
    assert isinstance(road.producer, SingleTurn) and [s.name for s in road.sources] == ["one"]
    assert road.sampling == Sampling(0.9, 7) and road.temperature == 0.9


def test_a_run_with_an_environment_plays_episodes_and_weighs_its_reward_as_a_source(tmp_path, tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")  # the chat template's turn end: observations follow it
    _, road = _road(tmp_path, tokenizer, end, environment__path="guess_number", environment__reward_weight=0.25)
    assert isinstance(road.producer, MultiTurn)
    assert [s.name for s in road.sources] == ["one", "environment"]
    assert isinstance(road.sources[1], EnvironmentReward) and road.sources[1].weight == 0.25


def test_a_call_samples_with_its_own_settings(tmp_path, tokenizer):
    """The run's settings by default; a call's own (the TRL drop-in's near-greedy completions) when passed: here
    at most 2 new tokens instead of the run's 12."""
    _, road = _road(tmp_path, tokenizer, rollout__max_new_tokens=12)
    token_lists = [tokenizer.encode(p) for p in PROMPTS[:3]]
    ids, mask = left_pad(token_lists, tokenizer.pad_token_id)
    prompts = EpisodePrompts(PromptBatch(ids, mask, token_lists, seeds=[1, 2, 3]), PROMPTS[:3])
    policy = tiny_llama(tokenizer)
    assert road.episodes(policy, prompts).response_mask.sum(1).tolist() == [12] * 3
    short = road.episodes(policy, prompts, Sampling(0.5, 2))
    assert short.response_mask.sum(1).tolist() == [2] * 3 and short.truncated.all()
