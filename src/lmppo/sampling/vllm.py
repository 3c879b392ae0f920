"""`rollout.backend: vllm`: sampling with a vLLM engine colocated with training (same process, same GPU).

Design notes: docs/design.md, `lmppo.sampling.vllm`."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
from contextlib import ExitStack
from typing import Callable, Iterator, Optional, Protocol, Sequence

import torch
from torch import nn

from lmppo.errors import ConfigError, LmppoError
from lmppo.models.loading import hf_model
from lmppo.models.parts import module_dict, optional_parameter, parameter
from lmppo.sampling.settings import Sampling

TARGET_VLLM = "0.10 / 0.11"
OTHER_BACKENDS = "use rollout.backend `native` (the default) or `hf` on this machine"


# ----------------------------------------------------------------------------- availability


def check_vllm_available(config) -> None:
    """Raise ConfigError naming `rollout.backend` unless this machine can run the vLLM backend: a CUDA GPU and the
    `vllm` package. Called before any model is loaded."""
    if config.device == "cpu":
        raise ConfigError(
            "rollout.backend", "vllm", f"needs a CUDA GPU, but this run has device `cpu`; {OTHER_BACKENDS}"
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            "rollout.backend",
            "vllm",
            "needs an NVIDIA GPU (CUDA), and torch sees none here "
            f"(torch.cuda.is_available() is False); {OTHER_BACKENDS}",
        )
    if not _vllm_installed():
        raise ConfigError(
            "rollout.backend",
            "vllm",
            "needs the `vllm` package, which is not installed: "
            f"pip install 'lmppo[vllm]' (vLLM {TARGET_VLLM}, on a machine with an NVIDIA GPU); "
            f"otherwise {OTHER_BACKENDS}",
        )


def _vllm_installed() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a broken or spec-less `vllm` entry in sys.modules
        return False


# ----------------------------------------------------------------------------- sampling settings


def pure_sampling_kwargs(temperature: float, max_new_tokens: int, stop_ids: Sequence[int], seed: int) -> dict:
    """Arguments for one `vllm.SamplingParams`: pure sampling from softmax(logits / temperature).

    Every setting that bends the distribution is given its neutral value explicitly (top_k 0 means "all tokens"
    in vLLM 0.10+, where -1 is accepted as well); `ignore_eos` stops vLLM from ending responses at the model's own
    EOS ids, so that exactly `stop_ids` end a response (vLLM still stops at `stop_token_ids` with it set);
    `detokenize` is off because lmppo decodes the token ids itself. No logprobs are requested."""
    return {
        "n": 1,
        "temperature": float(temperature),
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "min_tokens": 0,
        "max_tokens": int(max_new_tokens),
        "stop_token_ids": [int(t) for t in stop_ids],
        "ignore_eos": True,
        "seed": int(seed),
        "logprobs": None,
        "prompt_logprobs": None,
        "detokenize": False,
    }


# ----------------------------------------------------------------------------- what lmppo reads of vLLM (untyped)


class CompletionOutput(Protocol):
    """`vllm.CompletionOutput`: one sampled response."""

    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def finish_reason(self) -> Optional[str]: ...


class RequestOutput(Protocol):
    """`vllm.RequestOutput`: the responses to one prompt (lmppo asks for one)."""

    @property
    def outputs(self) -> Sequence[CompletionOutput]: ...


Weights = list[tuple[str, torch.Tensor]]
"""(HF parameter name, tensor) pairs, as `load_weights` takes them."""


class LoadsWeights(Protocol):
    def load_weights(self, weights: Weights) -> object: ...


class ModelRunner(Protocol):
    @property
    def model(self) -> LoadsWeights: ...


class Worker(Protocol):
    """The (in-process) vLLM worker `LLM.collective_rpc` runs a function on."""

    @property
    def model_runner(self) -> ModelRunner: ...


class MakesSamplingParams(Protocol):
    """`vllm.SamplingParams`, built from `pure_sampling_kwargs`."""

    def __call__(self, **kwargs: object) -> object: ...


class Engine(Protocol):
    """What lmppo calls of a `vllm.LLM`."""

    def generate(
        self, prompts: list[dict[str, list[int]]], *, sampling_params: list[object], use_tqdm: bool
    ) -> Sequence[RequestOutput]: ...
    def collective_rpc(self, method: Callable[[Worker, Weights], object], *, args: tuple[Weights]) -> object: ...
    def sleep(self, *, level: int) -> None: ...
    def wake_up(self, *, tags: list[str]) -> None: ...
    def reset_prefix_cache(self) -> object: ...


# ----------------------------------------------------------------------------- outputs -> response tensors


def outputs_to_responses(
    outputs: Sequence[RequestOutput],
    stop_ids: Sequence[int],
    max_new_tokens: int,
    pad_id: int,
    device: Optional[torch.device] = None,
):
    """vLLM `RequestOutput`s (one per prompt, in prompt order) -> the fields every lmppo sampler returns.

    Returns response_ids (B, T) with `pad_id` after the stop token, response_mask (B, T) bool, terminated (B,)
    bool (the response contains a stop token) and truncated (B,) bool (max_new_tokens reached without one);
    T is the longest response. A response's `terminated` comes from its tokens, not from vLLM's
    `finish_reason`: some vLLM versions check the length limit before the stop tokens, so a stop token sampled as
    the last allowed token can finish with reason "length" (lmppo's samplers count that response as terminated).
    `finish_reason` is checked for consistency; any output lmppo cannot interpret raises LmppoError."""
    stop = {int(t) for t in stop_ids}
    rows: list[list[int]] = []
    terminated: list[bool] = []
    for i, request in enumerate(outputs):
        completion = request.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        reason = completion.finish_reason
        first_stop = next((j for j, t in enumerate(ids) if t in stop), None)
        where = f"vLLM output {i} (finish_reason {reason!r}, {len(ids)} tokens)"
        if reason not in ("stop", "length"):
            raise LmppoError(f"{where}: the request did not finish normally; expected finish_reason 'stop' or 'length'")
        if not ids:
            raise LmppoError(f"{where}: an empty response; vLLM should produce at least one token")
        if len(ids) > max_new_tokens:
            raise LmppoError(f"{where}: more tokens than rollout.max_new_tokens ({max_new_tokens})")
        if first_stop is not None and first_stop != len(ids) - 1:
            raise LmppoError(
                f"{where}: tokens follow the stop token at position {first_stop}; vLLM should have "
                f"stopped there (stop ids {sorted(stop)})"
            )
        if reason == "stop" and first_stop is None:
            raise LmppoError(
                f"{where}: vLLM stopped at token {ids[-1]}, which is not one of the configured stop "
                f"ids {sorted(stop)} (rollout.stop_token); the engine must stop only at those"
            )
        if reason == "length" and len(ids) != max_new_tokens:
            raise LmppoError(
                f"{where}: cut before rollout.max_new_tokens ({max_new_tokens}), probably by the engine's max_model_len"
            )
        rows.append(ids)
        terminated.append(first_stop is not None)
    width = max([len(r) for r in rows] + [1])
    response_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    response_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, ids in enumerate(rows):
        response_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        response_mask[i, : len(ids)] = True
    terminated_t = torch.tensor(terminated, dtype=torch.bool)
    truncated_t = ~terminated_t & (response_mask.sum(1) >= max_new_tokens)
    return tuple(
        t.to(device) if device is not None else t for t in (response_ids, response_mask, terminated_t, truncated_t)
    )


# ----------------------------------------------------------------------------- weights for the engine


def engine_weights(policy: nn.Module, changed_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face checkpoint name, tensor) pairs that make the engine's model equal the policy.

    `changed_only=False`: every weight (LoRA layers merged). `changed_only=True`: only what training changes:
    every parameter with requires_grad, except that LoRA factors are replaced by their layer's merged weight
    (and bias, when the adapter trains one). Tensors are detached views of the policy's parameters or freshly
    computed merged weights; the policy itself is not modified. Yields lazily: one merged matrix at a time."""
    base = hf_model(policy)
    lora_layers = {name: module for name, module in base.named_modules() if _is_lora_layer(module)}
    for name, param in base.named_parameters():
        if _owning_lora_layer(name, lora_layers) is not None or ".original_module." in name:
            continue  # LoRA layers are sent merged below; `original_module` is the frozen copy of a saved module
        if changed_only and not param.requires_grad:
            continue
        yield re.sub(r"\.modules_to_save\.[^.]+\.", ".", name), param.detach()
    for path, module in lora_layers.items():
        weight, bias, bias_trained = merged_lora_layer(module)
        yield f"{path}.weight", weight
        if bias is not None and (bias_trained or not changed_only):
            yield f"{path}.bias", bias


def merged_lora_layer(module: nn.Module) -> tuple[torch.Tensor, Optional[torch.Tensor], bool]:
    """(weight, bias, whether an adapter trains the bias) of a PEFT LoRA layer with its active adapters merged:
    W + sum over adapters of scale * B @ A (PEFT's own `get_delta_weight`), computed without touching the layer."""
    get_base_layer: Callable[[], nn.Module] = getattr(module, "get_base_layer")
    base_layer = get_base_layer()
    weight = parameter(base_layer, "weight").detach()
    base_bias = optional_parameter(base_layer, "bias")
    bias = base_bias.detach() if base_bias is not None else None
    bias_trained = False
    if getattr(module, "merged") or getattr(module, "disable_adapters"):  # merged: in the base weight; disabled: off
        return weight, bias, bias_trained
    lora_a, lora_b = module_dict(module, "lora_A"), module_dict(module, "lora_B")
    delta_weight: Callable[[str], torch.Tensor] = getattr(module, "get_delta_weight")
    scaling: dict[str, float] = getattr(module, "scaling")
    active: list[str] = getattr(module, "active_adapters")
    for adapter in active:
        if adapter not in lora_a and adapter not in getattr(module, "lora_embedding_A", {}):
            continue
        variants = getattr(module, "lora_variant", {})
        if adapter in variants:
            raise LmppoError(
                f"the vLLM backend merges plain LoRA adapters; adapter `{adapter}` of this policy is a "
                f"variant ({type(variants[adapter]).__name__}, e.g. DoRA) that it cannot "
                "merge; use rollout.backend `native` or `hf`"
            )
        weight = weight + delta_weight(adapter).to(weight.dtype)
        if getattr(module, "lora_bias", {}).get(adapter, False):
            if bias is None:
                raise LmppoError(
                    f"adapter `{adapter}` trains a bias (lora_bias) on a layer without one: the vLLM model has no "
                    "bias there to load it into; use rollout.backend `native` or `hf`"
                )
            bias = bias + (parameter(lora_b[adapter], "bias") * scaling[adapter]).to(bias.dtype)
            bias_trained = True
    return weight.detach(), bias.detach() if bias is not None else None, bias_trained


def _is_lora_layer(module: nn.Module) -> bool:
    if not hasattr(module, "lora_A"):  # cheap test first: most modules are not LoRA layers
        return False
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def _owning_lora_layer(param_name: str, lora_layers: dict) -> Optional[str]:
    parts = param_name.split(".")
    for k in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:k])
        if prefix in lora_layers:
            return prefix
    return None


def _load_weights_on_worker(worker: Worker, weights: Weights) -> object:
    """Run by `LLM.collective_rpc` on the (in-process) vLLM worker: load HF-named weights into its model."""
    return worker.model_runner.model.load_weights(weights=weights)


# ----------------------------------------------------------------------------- the sampler


class VLLMSampler:
    """A colocated vLLM engine that samples rollouts from the current policy.

    `llm` is a `vllm.LLM` (or anything with its methods) and `sampling_params_cls` is `vllm.SamplingParams`;
    `create` builds both from the run's config."""

    def __init__(
        self,
        llm: Engine,
        sampling_params_cls: MakesSamplingParams,
        *,
        temperature: float,
        max_new_tokens: int,
        stop_ids: Sequence[int],
        pad_id: int,
        sleep: bool,
    ):
        self.llm, self.sampling_params_cls = llm, sampling_params_cls
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.stop_ids, self.pad_id = [int(t) for t in stop_ids], pad_id
        self.sleep = sleep
        self.asleep = False  # the engine is awake right after it is built
        self.syncs = 0  # weight syncs so far: the first sends every weight, later ones what training changes

    @classmethod
    def create(cls, config, policy: nn.Module, stop_ids: Sequence[int], pad_id: int) -> "VLLMSampler":
        """Build the engine for `policy`: its model folder gives the architecture, and its weights are synced in
        before the first rollout. Run `set_launcher_env` first."""
        from vllm import LLM, SamplingParams

        r = config.rollout
        llm = LLM(model=_model_source(config, policy), **engine_kwargs(config))
        return cls(
            llm,
            SamplingParams,
            temperature=r.temperature,
            max_new_tokens=r.max_new_tokens,
            stop_ids=stop_ids,
            pad_id=pad_id,
            sleep=r.vllm_sleep,
        )

    @torch.no_grad()
    def sample(
        self,
        policy: nn.Module,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int],
        device: Optional[torch.device] = None,
        sampling: Optional[Sampling] = None,
    ):
        """Sync the policy's weights into the engine, then sample one response per prompt (token-id lists, no
        padding) with its own seed, with `sampling`'s settings (None: those it was built with). Returns the same
        four tensors as `lmppo.sampling.native.sample_native`."""
        temperature, max_new_tokens = (
            (self.temperature, self.max_new_tokens)
            if sampling is None
            else (sampling.temperature, sampling.max_new_tokens)
        )
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        with _autocast_off():
            if self.asleep:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # return the training step's cached blocks before vLLM re-maps memory
                self.llm.wake_up(tags=["weights"])
            self.sync_weights(policy)
            if self.asleep:
                self.llm.wake_up(tags=["kv_cache"])
                self.asleep = False
            self.llm.reset_prefix_cache()  # cached KV entries were computed with the old weights
            params = [
                self.sampling_params_cls(**pure_sampling_kwargs(temperature, max_new_tokens, self.stop_ids, s))
                for s in seeds
            ]
            requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]  # a vllm.inputs.TokensPrompt
            outputs = self.llm.generate(requests, sampling_params=params, use_tqdm=False)
            if self.sleep:
                self.llm.sleep(level=1)
                self.asleep = True
        if len(outputs) != len(prompts):
            raise LmppoError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        return outputs_to_responses(outputs, self.stop_ids, max_new_tokens, self.pad_id, device)

    def sync_weights(self, policy: nn.Module, chunk_bytes: int = 1 << 30) -> None:
        """Load the policy's weights into the engine's model (everything on the first call, then what training
        changes; see `engine_weights`), in calls of at most about `chunk_bytes` each, so that merged LoRA weights
        never all exist at once."""
        chunk: Weights = []
        size = 0
        for name, tensor in engine_weights(policy, changed_only=self.syncs > 0):
            chunk.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= chunk_bytes:
                self.llm.collective_rpc(_load_weights_on_worker, args=(chunk,))
                chunk, size = [], 0
        if chunk:
            self.llm.collective_rpc(_load_weights_on_worker, args=(chunk,))
        self.syncs += 1


def engine_kwargs(config) -> dict:
    """Keyword arguments of `vllm.LLM` besides the model (see the module docstring for why each is set)."""
    r = config.rollout
    return {
        "skip_tokenizer_init": True,  # prompts go in as token ids, responses come out as token ids
        "trust_remote_code": config.model.trust_remote_code,
        "dtype": "bfloat16" if config.precision == "bf16" else "float32",  # the precision of the logprob passes
        "seed": config.seed,
        "gpu_memory_utilization": r.vllm_gpu_memory_utilization,
        "enable_sleep_mode": r.vllm_sleep,
        "max_model_len": config.data.max_prompt_length + r.max_new_tokens,
        "tensor_parallel_size": 1,
        "distributed_executor_backend": "external_launcher",  # engine core and worker in this process
        "generation_config": "vllm",  # ignore the model's generation_config.json (its sampling defaults)
    }


def set_launcher_env(rank: int, local_rank: int, world_size: int) -> None:
    """vLLM's `external_launcher` reads the torch.distributed variables; set those a launcher did not set."""
    for key, value in (
        ("RANK", rank),
        ("LOCAL_RANK", local_rank),
        ("WORLD_SIZE", world_size),
        ("MASTER_ADDR", "127.0.0.1"),
    ):
        os.environ.setdefault(key, str(value))
    if "MASTER_PORT" not in os.environ:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def _model_source(config, policy: nn.Module) -> str:
    """The folder (or hub id) the engine builds its model from: where the policy was loaded from."""
    source = getattr(hf_model(policy), "name_or_path", "") or ""
    if os.path.isfile(os.path.join(source, "config.json")):
        return source
    if config.model.policy.startswith("hub:") and source:
        return source
    raise LmppoError(
        "rollout.backend `vllm` builds its engine from the policy's model folder, but this policy "
        f"has none (name_or_path = {source!r}); save it with save_pretrained and give that folder as "
        "model.policy, or use rollout.backend `native`"
    )


def _autocast_off() -> ExitStack:
    """vLLM runs its own kernels at its own dtype; the trainer's bf16 autocast must not reach them, nor the merge."""
    stack = ExitStack()
    stack.enter_context(torch.autocast(device_type="cpu", enabled=False))
    if torch.cuda.is_available():
        stack.enter_context(torch.autocast(device_type="cuda", enabled=False))
    return stack
