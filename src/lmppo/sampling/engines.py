"""Sampling engines: how phase 1 draws the responses (`rollout.backend`). One interface, one registry.

Design notes: docs/design.md, `lmppo.sampling.engines`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

import torch
from torch import nn

import lmppo.sampling.vllm as vllm_backend
from lmppo.config import Config
from lmppo.registry import SAMPLING_ENGINES
from lmppo.sampling.cuda_graphs import DecodeGraphs
from lmppo.sampling.hf import left_pad, pure_sampling_config, sample_responses
from lmppo.sampling.native import SamplingWeights, sample_native
from lmppo.sampling.settings import Sampling
from lmppo.sampling.turns import CachedTurns, RepeatedPrefill, TurnSampler

if TYPE_CHECKING:
    from transformers import GenerationConfig

Responses = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""response_ids (B, T), response_mask (B, T) bool, terminated (B,) bool, truncated (B,) bool."""


@dataclass
class PromptBatch:
    """The prompts of one rollout on this process, each repeated `num_samples_per_prompt` times."""

    ids: torch.Tensor  # (B, P) left-padded prompt token ids
    mask: torch.Tensor  # (B, P) bool, True at real prompt tokens
    token_lists: list[list[int]]  # B unpadded prompt id lists (the rows of `ids` without padding)
    seeds: list[int]  # B per-response seeds (`lmppo.sampling.native.response_seed`)


@dataclass(frozen=True)
class OneProcess:
    """What an engine reads of the accelerator, for a command that runs in one process (`lmppo eval`)."""

    device: torch.device
    process_index: int = 0
    local_process_index: int = 0
    num_processes: int = 1
    is_main_process: bool = True


class ProcessLayout(Protocol):
    """What an engine reads of the accelerator (accelerate's `Accelerator`, or `OneProcess`)."""

    @property
    def device(self) -> torch.device: ...
    @property
    def process_index(self) -> int: ...
    @property
    def local_process_index(self) -> int: ...
    @property
    def num_processes(self) -> int: ...
    @property
    def is_main_process(self) -> bool: ...


class SamplingEngine:
    """One way to sample responses. Built once per run, after every model is loaded, from the run's config, the
    stop token ids, the pad id and the accelerator (device and process layout)."""

    name: str = ""
    samples_any_model: bool = True
    """`sample` reads the weights of the model it is handed at each call, so evaluation may hand it another model
    (the initial policy, a loaded checkpoint). False for an engine that holds its own copy of one model's weights
    (vLLM): evaluation then samples only the trained policy with it, or refuses (`lmppo eval`)."""

    def __init__(self, config: Config, stop_ids: torch.Tensor, pad_id: int, accelerator: ProcessLayout):
        self.config, self.stop_ids, self.pad_id, self.accelerator = config, stop_ids, pad_id, accelerator

    @classmethod
    def check(cls, config: Config) -> None:
        """Raise ConfigError when this machine cannot run the engine; called before any model is loaded."""

    def sample(self, policy: nn.Module, prompts: PromptBatch, sampling: Sampling) -> Responses:
        """One response per prompt from `policy` with this call's `sampling` settings."""
        raise NotImplementedError

    def turn_sampler(self, policy: nn.Module, sampling: Sampling) -> TurnSampler:
        """The turns of multi-turn episodes (`lmppo.sampling.turns`), each sampled with `sampling`. Here: `sample`
        on each episode's whole history every turn (token ids, re-encoded by the model each turn); an engine that
        can continue from its cache overrides this."""
        device = self.accelerator.device

        def sample(histories: list[list[int]], seeds: list[int]) -> Responses:
            ids, mask = left_pad(histories, self.pad_id)
            return self.sample(policy, PromptBatch(ids.to(device), mask.to(device), histories, seeds), sampling)

        return RepeatedPrefill(sample)


def register_sampling_engine(name: str) -> Callable[[type[SamplingEngine]], type[SamplingEngine]]:
    """Class decorator adding an engine to `lmppo.registry.SAMPLING_ENGINES`; a name registered twice is refused."""

    def deco(cls: type[SamplingEngine]) -> type[SamplingEngine]:
        SAMPLING_ENGINES.register(name)(cls)
        cls.name = name
        return cls

    return deco


def engine_class(name: str) -> type[SamplingEngine]:
    """The engine named by `rollout.backend`; ConfigError listing the registered names otherwise."""
    return SAMPLING_ENGINES.get(name)


@register_sampling_engine("native")
class NativeEngine(SamplingEngine):
    """lmppo's own loop (`lmppo.sampling.native.sample_native`): Gumbel-max over the KV-cached model, one random stream
    per response, so the same responses come out whatever the batching or number of processes. On CUDA the decoding
    step is replayed from CUDA graphs (`lmppo.sampling.cuda_graphs`), one per batch bucket. On a GPU under bf16
    autocast, and with LoRA on CPU, it runs a sampling copy of the policy (`lmppo.sampling.native.SamplingWeights`:
    linear weights in the autocast dtype, adapters folded in), refreshed at every rollout; under DeepSpeed the policy
    itself (its weights are gathered for generation)."""

    def __init__(self, config: Config, stop_ids: torch.Tensor, pad_id: int, accelerator: ProcessLayout):
        super().__init__(config, stop_ids, pad_id, accelerator)
        self.weights = SamplingWeights()
        self.copies = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None) is None
        # CUDA graphs of the decoding step, kept across rollouts; not under DeepSpeed (its gathered weights move)
        self.graphs = DecodeGraphs() if self.copies else None

    def sample(self, policy: nn.Module, prompts: PromptBatch, sampling: Sampling) -> Responses:
        s = sampling
        model = self.weights.model_for(policy) if self.copies else policy
        return sample_native(
            model, prompts.ids, prompts.mask, s.temperature, s.max_new_tokens, self.stop_ids, self.pad_id,
            prompts.seeds, graphs=self.graphs,
        )  # fmt: skip

    def turn_sampler(self, policy: nn.Module, sampling: Sampling) -> TurnSampler:
        """One KV cache kept across the turns (`lmppo.sampling.turns.CachedTurns`; the dynamic loop, no CUDA graphs)."""
        model = self.weights.model_for(policy) if self.copies else policy
        return CachedTurns(model, sampling.temperature, sampling.max_new_tokens, self.stop_ids, self.pad_id)


@register_sampling_engine("hf")
class HFEngine(SamplingEngine):
    """transformers' `generate` with a pure-sampling GenerationConfig (`lmppo.sampling.hf`), checked once by a probe;
    draws from the global torch RNG (the seeds are not used); `rollout.generation_kwargs` apply here only. With
    LoRA on CPU it generates from the same folded sampling copy as the native engine."""

    def __init__(self, config: Config, stop_ids: torch.Tensor, pad_id: int, accelerator: ProcessLayout):
        super().__init__(config, stop_ids, pad_id, accelerator)
        self.gen_config: Optional[GenerationConfig] = None  # built at the first call (its probe runs the policy)
        self.gen_sampling: Optional[Sampling] = None  # the settings `gen_config` was built for
        self.weights = SamplingWeights()
        self.copies = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None) is None

    def sample(self, policy: nn.Module, prompts: PromptBatch, sampling: Sampling) -> Responses:
        s, kwargs = sampling, self.config.rollout.generation_kwargs
        model = self.weights.model_for(policy) if self.copies else policy
        if self.gen_config is None or self.gen_sampling != s:  # built again when a call's settings differ
            self.gen_config = pure_sampling_config(
                model, s.temperature, s.max_new_tokens, self.stop_ids.tolist(), self.pad_id, kwargs
            )
            self.gen_sampling = s
        return sample_responses(model, prompts.ids, prompts.mask, self.gen_config, self.stop_ids, s.max_new_tokens)


@register_sampling_engine("vllm")
class VLLMEngine(SamplingEngine):
    """A colocated vLLM engine (`lmppo.sampling.vllm`), built at the first rollout (after every model is loaded, so
    vLLM sizes its memory around them), the policy's weights synced in before each rollout; the native seeds."""

    samples_any_model = False  # its engine holds the policy's weights, synced with what training changes

    def __init__(self, config: Config, stop_ids: torch.Tensor, pad_id: int, accelerator: ProcessLayout):
        super().__init__(config, stop_ids, pad_id, accelerator)
        self.sampler: Optional[vllm_backend.VLLMSampler] = None

    @classmethod
    def check(cls, config: Config) -> None:
        vllm_backend.check_vllm_available(config)  # a GPU and the `vllm` package

    def sample(self, policy: nn.Module, prompts: PromptBatch, sampling: Sampling) -> Responses:
        if self.sampler is None:
            acc = self.accelerator
            vllm_backend.set_launcher_env(acc.process_index, acc.local_process_index, acc.num_processes)
            self.sampler = vllm_backend.VLLMSampler.create(self.config, policy, self.stop_ids.tolist(), self.pad_id)
        return self.sampler.sample(policy, prompts.token_lists, prompts.seeds, self.accelerator.device, sampling)


def check_sampling_engine(config: Config) -> None:
    """ConfigError when `rollout.backend` names no engine or one this machine cannot run (before models load)."""
    engine_class(config.rollout.backend).check(config)


def build_sampling_engine(
    name: str, config: Config, stop_ids: torch.Tensor, pad_id: int, accelerator: ProcessLayout
) -> SamplingEngine:
    return engine_class(name)(config, stop_ids, pad_id, accelerator)


__all__: Sequence[str] = [
    "OneProcess",
    "PromptBatch",
    "SAMPLING_ENGINES",
    "Sampling",
    "SamplingEngine",
    "build_sampling_engine",
    "check_sampling_engine",
    "engine_class",
    "register_sampling_engine",
]
