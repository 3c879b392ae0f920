"""lmppo's own sampling loop (`rollout.backend: native`): pure sampling with per-response random streams.

Each response draws its randomness from its own generator, seeded from (run seed, iteration, the response's
position in the global batch). The same response therefore comes out whatever the micro-batching, the number
of processes, or an interruption and resume: a 2-process run samples what a 1-process run samples.
Sampling is Gumbel-max, argmax(logits / T + G) with G ~ Gumbel(0, 1), which draws exactly from
softmax(logits / T): no logits processor, nothing that bends the distribution.
The loop runs the HF model with its KV cache, computing logits only for the last position.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch
from torch import nn

from lmppo.core.masking import stop_token_mask
from lmppo.models import hf_model, position_ids_from_mask

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


def gumbel_noise(generators: Sequence[torch.Generator], vocab: int, device: torch.device) -> torch.Tensor:
    """(B, V) standard Gumbel noise, row b drawn from generators[b]."""
    u = torch.stack([torch.rand(vocab, generator=g) for g in generators]).to(device)
    return -torch.log(-torch.log(u.clamp(min=1e-20, max=1.0 - 1e-7)))


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _cache_argument(model: nn.Module) -> str:
    """The KV cache's keyword: `cache` from transformers 5.2x on, `past_key_values` before (and in PEFT wrappers)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(output) -> object:
    return output.cache if "cache" in output else output.past_key_values


@torch.no_grad()
def sample_native(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, temperature: float,
                  max_new_tokens: int, stop_ids: torch.Tensor, pad_id: int, seeds: Sequence[int]):
    """Sample one response per left-padded prompt.

    prompt_ids, prompt_mask: (B, P). seeds: B ints (see `response_seed`).
    Returns response_ids (B, T) padded with `pad_id` after the stop token, response_mask (B, T) bool,
    terminated (B,) bool, truncated (B,) bool; T <= max_new_tokens (trailing all-padding columns dropped).
    """
    device = prompt_ids.device
    model = hf_model(model)  # LoRA layers sit inside it; PEFT's wrapper would hide `logits_to_keep` and `cache`
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
    keep_kwargs = {"logits_to_keep": 1} if _accepts_logits_to_keep(model) else {}
    cache_argument = _cache_argument(model)
    attention = prompt_mask.long()
    positions = position_ids_from_mask(prompt_mask)
    out = model(input_ids=prompt_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                **keep_kwargs)
    past, logits = _cache_of(out), out.logits[:, -1]
    next_position = positions[:, -1] + 1  # (B,)
    finished = torch.zeros(prompt_ids.shape[0], dtype=torch.bool, device=device)
    stop = stop_ids.to(device)
    tokens = []
    for step in range(max_new_tokens):
        scores = logits.float() / temperature + gumbel_noise(generators, logits.shape[-1], device)
        token = torch.where(finished, torch.full_like(finished, pad_id, dtype=torch.long), scores.argmax(-1))
        tokens.append(token)
        finished = finished | torch.isin(token, stop)
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        attention = torch.cat([attention, (~finished).long()[:, None]], dim=1)
        out = model(input_ids=token[:, None], attention_mask=attention, position_ids=next_position[:, None],
                    use_cache=True, **{cache_argument: past}, **keep_kwargs)
        past, logits = _cache_of(out), out.logits[:, -1]
        next_position = next_position + 1
    response_ids = torch.stack(tokens, dim=1)
    response_mask, terminated = stop_token_mask(response_ids, stop)
    response_ids = torch.where(response_mask, response_ids, torch.full_like(response_ids, pad_id))
    truncated = ~terminated & (response_mask.sum(1) >= max_new_tokens)
    return response_ids, response_mask, terminated, truncated
