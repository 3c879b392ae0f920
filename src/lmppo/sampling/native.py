"""lmppo's own sampling loop (`rollout.backend: native`): pure sampling with per-response random streams.

Design notes: docs/design.md, `lmppo.sampling.native`."""

from __future__ import annotations

import copy
import inspect
from typing import Optional, Sequence

import torch
from torch import nn

from lmppo.core.masking import stop_token_mask
from lmppo.models.frozen_casts import reuse_frozen_casts
from lmppo.models.loading import hf_model, position_ids_from_mask
from lmppo.models.parts import module_dict, optional_parameter, parameter, submodule
from lmppo.sampling.cuda_graphs import DecodeGraphs, static_sample
from lmppo.sampling.noise import gumbel_argmax, seed_tensor
from lmppo.sampling.static_decoding import supports_static_decoding

DECODINGS = ("auto", "dynamic", "static")
_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def response_seed(seed: int, iteration: int, position: int) -> int:
    """A 63-bit seed for one response, mixed (splitmix64-style) from the run seed, iteration and position."""
    x = (seed * _MIX[0] + iteration * _MIX[1] + position * _MIX[2] + 1) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 30
    x = (x * _MIX[1]) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 27
    x = (x * _MIX[2]) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _cache_argument(model: nn.Module) -> str:
    """The KV cache's keyword: `cache` from transformers 5.2x on, `past_key_values` before (and in PEFT wrappers)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(output) -> object:
    return output.cache if "cache" in output else output.past_key_values


@torch.no_grad()
def sample_native(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    temperature: float,
    max_new_tokens: int,
    stop_ids: torch.Tensor,
    pad_id: int,
    seeds: Sequence[int],
    decoding: str = "auto",
    stop_check_every: int = 8,
    graphs: Optional[DecodeGraphs] = None,
):
    """Sample one response per left-padded prompt.

    prompt_ids, prompt_mask: (B, P). seeds: B ints (see `response_seed`).
    decoding: "dynamic" (the HF cache grown a token at a time, a host check per step), "static"
    (`lmppo.sampling.static_decoding`: preallocated cache, stop checked every `stop_check_every` steps, replayed from
    a CUDA graph when `graphs` is given on CUDA) or "auto" (static with graphs when `graphs` is given on CUDA and the
    model supports it, else dynamic).
    Both give the same tokens for the same seeds. Returns response_ids (B, T) padded with `pad_id` after the stop
    token, response_mask (B, T) bool, terminated (B,) bool, truncated (B,) bool; T <= max_new_tokens (trailing
    all-padding columns dropped).
    """
    if decoding not in DECODINGS:
        raise ValueError(f"decoding={decoding!r}: allowed {', '.join(DECODINGS)}")
    if stop_check_every < 1:
        raise ValueError(f"stop_check_every={stop_check_every}: must be >= 1")
    device = prompt_ids.device
    model = hf_model(model)  # LoRA layers sit inside it; PEFT's wrapper would hide `logits_to_keep` and `cache`
    seed_rows = seed_tensor(seeds, device)  # one host-to-device copy per rollout; the noise is made on the device
    stop = stop_ids.to(device)
    # eagerly the static step is slower than the dynamic loop (34 against 29 ms/step on an H100): static only in graphs
    static = decoding == "static" or (
        decoding == "auto" and device.type == "cuda" and graphs is not None and supports_static_decoding(model)
    )
    if static and not supports_static_decoding(model):
        raise ValueError(
            f"decoding='static': {type(model).__name__} is not supported (needs a transformers 5.2x decoder taking "
            "`cache`, `position_ids` and `logits_to_keep`, with attn_implementation 'sdpa'); use 'dynamic' or 'auto'"
        )
    if static:
        tokens, taken = static_sample(
            model, prompt_ids, prompt_mask.bool(), seed_rows, temperature, max_new_tokens, stop, pad_id,
            stop_check_every, graphs,
        )  # fmt: skip
        response_ids = tokens[:, :taken]
    else:
        response_ids = _sample_dynamic(
            model, prompt_ids, prompt_mask, temperature, max_new_tokens, stop, pad_id, seed_rows
        )
    response_mask, terminated = stop_token_mask(response_ids, stop)
    if static:  # the dynamic loop ends at the step where the last row stopped; drop the static loop's extra steps
        keep = int(response_mask.sum(1).max())
        response_ids, response_mask = response_ids[:, :keep], response_mask[:, :keep]
    response_ids = torch.where(response_mask, response_ids, torch.full_like(response_ids, pad_id))
    truncated = ~terminated & (response_mask.sum(1) >= max_new_tokens)
    return response_ids, response_mask, terminated, truncated


def _sample_dynamic(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    temperature: float,
    max_new_tokens: int,
    stop: torch.Tensor,
    pad_id: int,
    seeds: torch.Tensor,
) -> torch.Tensor:
    """The eager loop over HF's growing cache: (B, T) tokens, padding after each row's stop token."""
    keep_kwargs = {"logits_to_keep": 1} if _accepts_logits_to_keep(model) else {}
    cache_argument = _cache_argument(model)
    attention = prompt_mask.long()
    positions = position_ids_from_mask(prompt_mask)
    out = model(input_ids=prompt_ids, attention_mask=attention, position_ids=positions, use_cache=True, **keep_kwargs)
    past, logits = _cache_of(out), out.logits[:, -1]
    next_position = positions[:, -1] + 1  # (B,)
    finished = torch.zeros(prompt_ids.shape[0], dtype=torch.bool, device=prompt_ids.device)
    tokens = []
    for step in range(max_new_tokens):
        token = gumbel_argmax(logits, temperature, seeds, step)
        token = torch.where(finished, torch.full_like(token, pad_id), token)
        tokens.append(token)
        finished = finished | (token[:, None] == stop[None, :]).any(-1)
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        attention = torch.cat([attention, (~finished).long()[:, None]], dim=1)
        out = model(
            input_ids=token[:, None],
            attention_mask=attention,
            position_ids=next_position[:, None],
            use_cache=True,
            **{cache_argument: past},
            **keep_kwargs,
        )
        past, logits = _cache_of(out), out.logits[:, -1]
        next_position = next_position + 1
    return torch.stack(tokens, dim=1)


def _lora_parts(module: nn.Module) -> Optional[list[tuple[torch.Tensor, torch.Tensor, float]]]:
    """(A, B, scale) of each active adapter of a PEFT LoRA linear layer (none while its adapters are switched off,
    `disable_adapter()`); None for a layer that is not one."""
    if not (hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")):
        return None
    if getattr(module, "disable_adapters", False):
        return []
    lora_a, lora_b = module_dict(module, "lora_A"), module_dict(module, "lora_B")
    scaling: dict[str, float] = getattr(module, "scaling")
    active: list[str] = getattr(module, "active_adapters")
    return [
        (parameter(lora_a[name], "weight"), parameter(lora_b[name], "weight"), float(scaling[name]))
        for name in active
        if name in lora_a
    ]


def _foldable(module: nn.Module) -> bool:
    """A LoRA layer around a floating-point nn.Linear that a weight fold reproduces exactly: no DoRA, not merged, no
    dropout active, weights not transposed (GPT-2's Conv1D)."""
    base = submodule(module, "base_layer")
    dropout_on = any(d.training and getattr(d, "p", 0.0) > 0 for d in module_dict(module, "lora_dropout").values())
    dora = any(getattr(module, "use_dora", {}).values())
    return (
        type(base) is nn.Linear
        and parameter(base, "weight").is_floating_point()
        and not dropout_on
        and not dora
        and not getattr(module, "merged", False)
        and not getattr(module, "fan_in_fan_out", False)
    )


class SamplingWeights:
    """The model the native sampler runs: a copy whose linear layers are plain nn.Linear in the autocast dtype, made
    from the policy's at every call (once per rollout, not at every decoding step), sharing every other tensor
    (embeddings, norms) with the policy; or the policy's own model where a copy gains nothing.

    A copy is made (1) on a GPU under bf16/fp16 autocast: every fp32 linear layer (autocast would otherwise cast
    each weight again at each of a rollout's decoding steps; a cast copy computes the same thing), LoRA layers with
    their adapters folded in; (2) for a LoRA policy on CPU: the LoRA layers folded; `cpu_working_copy=True` copies
    every linear layer on CPU too (without LoRA a copy gains nothing measurable there, docs/performance.md).

    `model_for(policy)` rebuilds the copy when handed another policy and refreshes its linear weights from the
    policy's at every call (fused optimizers update in place without bumping tensor versions; in place, so
    captured CUDA graphs stay valid)."""

    def __init__(self, cpu_working_copy: bool = False) -> None:
        self.source: Optional[nn.Module] = None
        self.copy: Optional[nn.Module] = None
        self.layers: list[tuple[nn.Module, nn.Linear]] = []  # (policy's layer, the copy's plain layer)
        self.dtype: Optional[torch.dtype] = None
        self.working = False  # every linear layer copied, not only the LoRA ones
        self.refreshes = 0
        self.cpu_working_copy = cpu_working_copy
        self.keep_casts = (
            True  # the copy's other frozen linear layers (the LM head) cast once (lmppo.models.frozen_casts)
        )

    @staticmethod
    def compute_dtype(device_type: str = "cpu") -> Optional[torch.dtype]:
        """The dtype the copy's linear weights take: the autocast dtype of `device_type` when autocast is on there,
        else None (the weights' own dtype)."""
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None

    def model_for(self, policy: nn.Module) -> nn.Module:
        model = hf_model(policy)
        params = list(model.parameters())
        if not params:
            return model
        device = params[0].device.type
        dtype = self.compute_dtype(device)
        working = dtype in (torch.bfloat16, torch.float16) and (device != "cpu" or self.cpu_working_copy)
        lora = any(_lora_parts(m) is not None for m in model.modules())
        if not working and not (lora and device == "cpu"):
            return model
        if self.source is not model or self.dtype != dtype or self.working != working:
            if not self._build(model, dtype, working):
                return model
        self._refresh()  # every call: fused optimizers update in place without bumping tensor versions
        assert self.copy is not None, "_build made the copy"
        reuse_frozen_casts(self.copy, enabled=self.keep_casts and self.dtype is not None)  # under autocast
        return self.copy

    def _build(self, model: nn.Module, dtype: Optional[torch.dtype], working: bool) -> bool:
        """The copy: LoRA layers folded, and with `working` every other fp32 nn.Linear too, in `dtype`."""
        lora = [(name, m) for name, m in model.named_modules() if _lora_parts(m) is not None]
        inside_lora = {f"{name}.{child}" for name, _ in lora for child, _ in model.get_submodule(name).named_modules()}
        linear = [
            (name, m)
            for name, m in model.named_modules()
            if working and isinstance(m, nn.Linear) and m.weight.dtype == torch.float32 and name not in inside_lora
        ]
        targets = lora + linear
        if any(not _foldable(m) for _, m in lora):
            self.source = self.copy = None
            return False
        shared = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
        clone = copy.deepcopy(model, memo=shared)  # new modules around the same parameters and buffers
        layers = []
        for name, m in targets:
            base = submodule(m, "base_layer") if _lora_parts(m) is not None else m
            weight = parameter(base, "weight")
            # built on the meta device, then given empty storage: no random init, the global RNG is left untouched
            out_features, in_features = weight.shape
            plain = nn.Linear(
                in_features,
                out_features,
                bias=optional_parameter(base, "bias") is not None,
                device="meta",
                dtype=dtype or weight.dtype,
            ).to_empty(device=weight.device)
            plain.requires_grad_(False)
            parent_name, _, attr = name.rpartition(".")
            setattr(clone.get_submodule(parent_name) if parent_name else clone, attr, plain)
            layers.append((m, plain))
        self.source, self.copy, self.layers, self.dtype, self.working = model, clone.eval(), layers, dtype, working
        return True

    @torch.no_grad()
    def _refresh(self) -> None:
        for layer, plain in self.layers:
            parts = _lora_parts(layer) or []  # [] for a plain linear layer or switched-off adapters
            base = submodule(layer, "base_layer") if hasattr(layer, "base_layer") else layer
            weight = parameter(base, "weight").float()
            for a, b, scale in parts:
                weight = weight + scale * (b.float() @ a.float())
            plain.weight.copy_(weight)
            bias = optional_parameter(base, "bias")
            if bias is not None:
                plain.bias.copy_(bias)
        self.refreshes += 1
