"""The vLLM backend (`lmppo.sampling.vllm`) without vLLM: availability errors, the conversion of vLLM's outputs,
the weights sent to the engine, the sampling settings, and the trainer driving a fake engine.

vLLM itself (and a GPU) is not available here: the fake engine below records what lmppo asks of `vllm.LLM` and
answers with objects shaped like vLLM's `RequestOutput` / `CompletionOutput`. Nothing here shows that vLLM
behaves as its documentation says; see docs/distributed.md."""

from __future__ import annotations

import copy
import sys
import types
from dataclasses import dataclass
from typing import Any, Optional, Union

import pytest
import torch
from torch import nn

from conftest import PROMPTS, small_config, tiny_llama
from lmppo.config import Config, ModelConfig, RolloutConfig, field_docs
from lmppo.errors import ConfigError, LmppoError
from lmppo.models.loading import prepare_policy
from lmppo.sampling import vllm as vllm_backend
from lmppo.sampling.native import response_seed
from lmppo.sampling.vllm import (
    VLLMSampler,
    engine_kwargs,
    engine_weights,
    merged_lora_layer,
    outputs_to_responses,
    pure_sampling_kwargs,
)

STOP, PAD = 2, 0  # the test tokenizer's eos and pad ids


# ----------------------------------------------------------------------------- a fake vLLM


@dataclass
class CompletionOutput:
    """Shaped like vllm.outputs.CompletionOutput."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    lora_request: Any = None


@dataclass
class RequestOutput:
    """Shaped like vllm.outputs.RequestOutput (the fields lmppo reads and those around them)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: Optional[list[int]]
    prompt_logprobs: Optional[list]
    outputs: list[CompletionOutput]
    finished: bool


def request_output(token_ids, finish_reason, stop_reason=None, i=0):
    return RequestOutput(
        str(i),
        None,
        [5, 6],
        None,
        [CompletionOutput(0, "", list(token_ids), None, None, finish_reason, stop_reason)],
        True,
    )


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.__dict__.update(kwargs)


class FakeModel:
    def __init__(self):
        self.loads: list[list[tuple[str, torch.Tensor]]] = []
        self.awake = True

    def load_weights(self, weights):
        assert self.awake, "weights loaded into a sleeping engine"
        self.loads.append([(n, t.detach().clone()) for n, t in weights])
        return {n for n, _ in self.loads[-1]}


class FakeLLM:
    """Records the calls lmppo makes; samples tokens from each request's seed; tracks what is awake."""

    instances: list["FakeLLM"] = []

    def __init__(self, model, **kwargs):
        self.model_source, self.kwargs = model, kwargs
        self.model = FakeModel()
        self.worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=self.model))
        self.kv_awake = True
        self.calls: list[tuple] = []
        self.requests: list[tuple[list, list]] = []
        self.last_outputs: list[RequestOutput] = []
        FakeLLM.instances.append(self)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert callable(method)
        self.calls.append(("collective_rpc",))
        return [method(self.worker, *args, **(kwargs or {}))]

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))
        if tags is None or "weights" in tags:
            self.model.awake = True
        if tags is None or "kv_cache" in tags:
            self.kv_awake = True

    def sleep(self, level=1):
        self.calls.append(("sleep", level))
        self.model.awake = self.kv_awake = False

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None):
        assert self.model.awake and self.kv_awake, "generate on a sleeping engine"
        self.calls.append(("generate",))
        self.requests.append((prompts, sampling_params))
        outputs = []
        for i, (prompt, sp) in enumerate(zip(prompts, sampling_params)):
            g = torch.Generator().manual_seed(sp.seed)
            ids, reason = [], "length"
            for _ in range(sp.max_tokens):
                stop_now = sp.stop_token_ids and torch.rand((), generator=g).item() < 0.25
                ids.append(sp.stop_token_ids[0] if stop_now else int(torch.randint(5, 40, (), generator=g)))
                if ids[-1] in sp.stop_token_ids:
                    reason = "stop"
                    break
            outputs.append(
                RequestOutput(
                    str(i),
                    None,
                    prompt["prompt_token_ids"],
                    None,
                    [CompletionOutput(0, "", ids, None, None, reason, ids[-1] if reason == "stop" else None)],
                    True,
                )
            )
        self.last_outputs = outputs
        return outputs


@pytest.fixture()
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = FakeLLM, FakeSamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    for key, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29555"),
    ):
        monkeypatch.setenv(key, value)  # restored after the test, whatever lmppo sets
    FakeLLM.instances.clear()
    return module


# ----------------------------------------------------------------------------- availability and config


def vllm_config(tmp_path, policy_dir) -> Config:
    cfg = small_config(tmp_path / "run", rollout__backend="vllm")
    cfg.model.policy = policy_dir
    return cfg


def test_no_gpu_is_a_config_error_naming_the_field_before_any_model_loads(
    tmp_path, tiny_model_dir, tokenizer, monkeypatch
):
    import lmppo.training.assembly as assembly_module
    import lmppo.training.trainer as trainer_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the backend was checked")

    monkeypatch.setattr(assembly_module, "load_policy", no_loading)
    cfg = vllm_config(tmp_path, tiny_model_dir)
    with pytest.raises(ConfigError) as err:
        trainer_module.PPOTrainer(
            cfg, tokenizer=tokenizer, prompts=PROMPTS, reward_functions=[lambda p, c: [0.0] * len(c)]
        )
    assert err.value.field == "rollout.backend" and err.value.value == "vllm"
    message = str(err.value)
    assert "rollout.backend" in message and "GPU" in message and "`native`" in message and "`hf`" in message
    assert not (tmp_path / "run").exists()  # refused before the output folder was even prepared


def test_missing_vllm_package_is_a_config_error(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", None)  # importlib then reports vllm as not installed
    with pytest.raises(ConfigError) as err:
        vllm_backend.check_vllm_available(vllm_config(tmp_path, tiny_model_dir))
    assert err.value.field == "rollout.backend"
    assert "pip install 'lmppo[vllm]'" in str(err.value) and "`native`" in str(err.value)


def test_config_checks_for_the_vllm_fields(tmp_path, tiny_model_dir):
    cfg = vllm_config(tmp_path, tiny_model_dir)
    cfg.device = "cpu"
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert err.value.field == "rollout.backend" and "device `cpu`" in str(err.value)
    cfg = vllm_config(tmp_path, tiny_model_dir)
    cfg.rollout.temperature = 0.005  # vLLM would raise it to 0.01
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert err.value.field == "rollout.temperature"
    for bad in (0.0, 1.5, -0.1):
        cfg = vllm_config(tmp_path, tiny_model_dir)
        cfg.rollout.vllm_gpu_memory_utilization = bad
        with pytest.raises(ConfigError) as err:
            cfg.validate()
        assert err.value.field == "rollout.vllm_gpu_memory_utilization"
    cfg = vllm_config(tmp_path, tiny_model_dir)
    cfg.rollout.vllm_gpu_memory_utilization, cfg.rollout.vllm_sleep = 1.0, False
    cfg.validate()
    docs = field_docs(RolloutConfig)
    assert "vllm_gpu_memory_utilization" in docs and "vllm_sleep" in docs


# ----------------------------------------------------------------------------- outputs -> tensors


def test_outputs_become_the_rollout_fields():
    """max_tokens 4, stop id 2, pad 0. Row 0 stops on the stop token; row 1 is cut at max_tokens; row 2 samples the
    stop token as its 4th and last allowed token (vLLM versions that test the length first report "length"); row 3
    is the stop token alone."""
    outputs = [
        request_output([5, 6, STOP], "stop", STOP, 0),
        request_output([7, 8, 9, 10], "length", None, 1),
        request_output([11, 12, 13, STOP], "length", None, 2),
        request_output([STOP], "stop", STOP, 3),
    ]
    ids, mask, terminated, truncated = outputs_to_responses(outputs, [STOP], 4, PAD)
    assert ids.tolist() == [[5, 6, 2, 0], [7, 8, 9, 10], [11, 12, 13, 2], [2, 0, 0, 0]]
    assert mask.tolist() == [
        [True, True, True, False],
        [True, True, True, True],
        [True, True, True, True],
        [True, False, False, False],
    ]
    assert terminated.tolist() == [True, False, True, True]
    assert truncated.tolist() == [False, True, False, False]
    assert ids.dtype == torch.long and mask.dtype == torch.bool


def test_width_is_the_longest_response_and_padding_may_equal_the_stop_id():
    outputs = [request_output([5, STOP], "stop", STOP), request_output([6, 7, STOP], "stop", STOP)]
    ids, mask, terminated, truncated = outputs_to_responses(outputs, [STOP], 8, pad_id=STOP)
    assert ids.tolist() == [[5, 2, 2], [6, 7, 2]]  # the row-0 pad equals the stop id; only the mask tells them apart
    assert mask.tolist() == [[True, True, False], [True, True, True]]
    assert terminated.tolist() == [True, True] and truncated.tolist() == [False, False]
    # no stop token configured: every response runs to max_tokens, none terminated
    ids, mask, terminated, truncated = outputs_to_responses([request_output([STOP, 9], "length")], [], 2, PAD)
    assert ids.tolist() == [[2, 9]] and mask.all() and truncated.tolist() == [True] and terminated.tolist() == [False]


@pytest.mark.parametrize(
    "token_ids, reason, why",
    [
        ([5, 6, 3], "stop", "not one of the configured stop ids"),  # stopped at an EOS lmppo did not configure
        ([5, 6], "length", "cut before"),  # finished on length before max_tokens
        ([5, STOP, 6, 7], "length", "tokens follow the stop token"),
        ([5, 6, 7, 8, 9], "length", "more tokens than"),
        ([5], "abort", "did not finish normally"),
        ([], "stop", "empty response"),
    ],
)
def test_outputs_lmppo_cannot_interpret_raise(token_ids, reason, why):
    with pytest.raises(LmppoError, match=why):
        outputs_to_responses([request_output(token_ids, reason)], [STOP], 4, PAD)


# ----------------------------------------------------------------------------- sampling settings


def test_sampling_params_are_pure_sampling():
    assert pure_sampling_kwargs(0.7, 24, [2, 4], 123) == {
        "n": 1,
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "min_tokens": 0,
        "max_tokens": 24,
        "stop_token_ids": [2, 4],
        "ignore_eos": True,
        "seed": 123,
        "logprobs": None,
        "prompt_logprobs": None,
        "detokenize": False,
    }


def test_engine_arguments(tmp_path, tiny_model_dir):
    cfg = vllm_config(tmp_path, tiny_model_dir)
    cfg.precision, cfg.data.max_prompt_length = "bf16", 40
    kwargs = engine_kwargs(cfg)
    assert kwargs["enable_sleep_mode"] is True and kwargs["gpu_memory_utilization"] == 0.3
    assert kwargs["dtype"] == "bfloat16" and kwargs["max_model_len"] == 40 + cfg.rollout.max_new_tokens
    assert kwargs["distributed_executor_backend"] == "external_launcher" and kwargs["tensor_parallel_size"] == 1
    assert kwargs["skip_tokenizer_init"] is True and kwargs["generation_config"] == "vllm"
    cfg.precision = "fp32"
    assert engine_kwargs(cfg)["dtype"] == "float32"


# ----------------------------------------------------------------------------- weights sent to the engine


def test_full_weights_are_sent_under_their_hf_names(tokenizer):
    model = tiny_llama(tokenizer)
    sent = list(engine_weights(model))
    expected = dict(model.named_parameters())
    assert [n for n, _ in sent] == list(expected)  # e.g. model.layers.0.self_attn.q_proj.weight, lm_head.weight
    assert "lm_head.weight" in expected and "model.embed_tokens.weight" in expected
    for name, tensor in sent:
        assert tensor.data_ptr() == expected[name].data_ptr()  # the parameter itself, not a copy
    assert [n for n, _ in engine_weights(model, changed_only=True)] == list(expected)  # all weights train


def lora_policy(tokenizer, seed=3):
    mc = ModelConfig()
    mc.lora.enabled = True
    policy = prepare_policy(tiny_llama(tokenizer), mc)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a trained adapter: B != 0, so merging changes the weights
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return policy


def test_lora_weights_are_sent_merged_without_peft_names(tokenizer):
    policy = lora_policy(tokenizer)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    reference = copy.deepcopy(policy).merge_and_unload()  # PEFT's own merge
    expected = dict(reference.named_parameters())
    full = dict(engine_weights(policy))
    assert set(full) == set(expected) == set(dict(tiny_llama(tokenizer).named_parameters()))
    assert not any("lora_" in n or "base_layer" in n or n.startswith("base_model") for n in full)
    for name, tensor in full.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
    changed = dict(engine_weights(policy, changed_only=True))
    adapted = {
        f"model.layers.{i}.{m}.weight"
        for i in range(2)
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    assert set(changed) == adapted  # only the layers LoRA adapts; embeddings, norms and head never change
    base = dict(tiny_llama(tokenizer).named_parameters())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(changed[q], base[q])  # the adapter is in the merged weight
    for name, tensor in changed.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
    for name, p in policy.named_parameters():  # the training model was not merged in place
        assert torch.equal(p, before[name]), name


# ----------------------------------------------------------------------------- the sampler with a fake engine


def test_sampler_syncs_weights_wakes_and_sleeps_in_order(tokenizer):
    llm = FakeLLM("folder")
    sampler = VLLMSampler(
        llm, FakeSamplingParams, temperature=0.9, max_new_tokens=5, stop_ids=[STOP], pad_id=PAD, sleep=True
    )
    policy = lora_policy(tokenizer)
    prompts, seeds = [[5, 6, 7], [8, 9]], [response_seed(0, 0, 0), response_seed(0, 0, 1)]
    ids, mask, terminated, truncated = sampler.sample(policy, prompts, seeds)
    assert llm.calls == [("collective_rpc",), ("reset_prefix_cache",), ("generate",), ("sleep", 1)]
    assert len(llm.model.loads[0]) == len(dict(tiny_llama(tokenizer).named_parameters()))  # the first sync: all
    sent_prompts, params = llm.requests[0]
    assert sent_prompts == [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    assert [p.kwargs for p in params] == [pure_sampling_kwargs(0.9, 5, [STOP], s) for s in seeds]
    expected = outputs_to_responses(llm.last_outputs, [STOP], 5, PAD)
    for got, want in zip((ids, mask, terminated, truncated), expected):
        assert torch.equal(got, want)
    llm.calls.clear()
    sampler.sample(policy, prompts, seeds)
    assert llm.calls == [
        ("wake_up", ("weights",)),
        ("collective_rpc",),
        ("wake_up", ("kv_cache",)),
        ("reset_prefix_cache",),
        ("generate",),
        ("sleep", 1),
    ]
    assert len(llm.model.loads[1]) == 14  # later syncs: the 2 x 7 adapted layers only


def test_weight_sync_is_chunked(tokenizer):
    llm = FakeLLM("folder")
    sampler = VLLMSampler(
        llm, FakeSamplingParams, temperature=1.0, max_new_tokens=3, stop_ids=[STOP], pad_id=PAD, sleep=False
    )
    model = tiny_llama(tokenizer)
    sampler.sync_weights(model, chunk_bytes=1)  # every tensor its own call
    assert len(llm.model.loads) == len(dict(model.named_parameters()))
    assert [n for load in llm.model.loads for n, _ in load] == list(dict(model.named_parameters()))


def test_policy_without_a_folder_is_refused(tmp_path, tokenizer, tiny_model_dir, fake_vllm):
    cfg = vllm_config(tmp_path, tiny_model_dir)
    with pytest.raises(LmppoError, match="model folder"):
        VLLMSampler.create(cfg, tiny_llama(tokenizer), [STOP], PAD)  # built in memory: no name_or_path


# ----------------------------------------------------------------------------- the trainer with a fake engine


def test_trainer_samples_with_the_engine_and_syncs_lora_weights(
    tmp_path, tokenizer, tiny_model_dir, fake_vllm, monkeypatch
):
    from lmppo.training.trainer import PPOTrainer

    monkeypatch.setattr(vllm_backend, "check_vllm_available", lambda config: None)  # no GPU here
    cfg = vllm_config(tmp_path, tiny_model_dir)
    cfg.model.lora.enabled = True
    trainer = PPOTrainer(
        cfg, tokenizer=tokenizer, prompts=PROMPTS, reward_functions=[lambda p, c: [len(x) / 20.0 for x in c]]
    )
    assert not FakeLLM.instances  # the engine is built at the first rollout, after every model is loaded
    rollout = trainer.collect_rollout()
    (llm,) = FakeLLM.instances
    assert llm.model_source == tiny_model_dir and llm.kwargs == engine_kwargs(cfg)
    want = outputs_to_responses(llm.last_outputs, [STOP], cfg.rollout.max_new_tokens, tokenizer.pad_token_id)
    assert torch.equal(rollout.response_ids, want[0]) and torch.equal(rollout.response_mask, want[1])
    assert torch.equal(rollout.terminated, want[2]) and torch.equal(rollout.truncated, want[3])
    seeds = [p.seed for p in llm.requests[0][1]]
    assert seeds == [response_seed(cfg.seed, 0, i) for i in range(cfg.rollout.batch_size)]  # the native seeds
    assert torch.isfinite(rollout.logprobs).all()  # logprobs come from the training model
    history = trainer.train()
    assert len(history) == 2 and len(FakeLLM.instances) == 1
    assert len(llm.model.loads) == 3  # one sync per rollout
    assert {n for n, _ in llm.model.loads[1]} == {n for n, _ in llm.model.loads[2]}
    assert all(".self_attn." in n or ".mlp." in n for n, _ in llm.model.loads[2])  # merged adapted layers only
    q = "model.layers.0.self_attn.q_proj.weight"
    first, last = dict(llm.model.loads[0])[q], dict(llm.model.loads[2])[q]
    assert not torch.equal(first, last)  # training moved the adapter, and the engine got the new merged weight
    assert llm.calls.count(("sleep", 1)) == 3 and llm.calls.count(("wake_up", ("weights",))) == 2


def test_a_lora_bias_on_a_layer_without_one_is_one_error():
    """peft accepts `lora_bias=True` on a bias-less linear layer (with a warning); vLLM's model has no bias there
    to load the merged one into: one LmppoError (before: a TypeError adding to None)."""
    import warnings

    from peft import LoraConfig, get_peft_model

    class Projection(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 3, bias=False)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's "merging LoRA weights won't be possible"
        model = get_peft_model(Projection(), LoraConfig(r=2, target_modules=["proj"], lora_bias=True))
    with pytest.raises(LmppoError, match=r"adapter `default` trains a bias \(lora_bias\) on a layer without one"):
        merged_lora_layer(model.base_model.model.proj)
