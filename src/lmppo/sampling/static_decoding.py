"""Static-shape decoding for the native sampler: a preallocated KV cache (transformers' `StaticCache`) and a decoding
step whose every tensor keeps its shape and address, so the step can be captured once in a CUDA graph and replayed
(`lmppo.sampling.cuda_graphs`). The same code runs eagerly on the CPU, where tests check it against the dynamic loop.

How it departs from the dynamic loop in `lmppo.sampling.native` (same tokens for the same noise):
- the attention mask is a preallocated (B, P + T) bool tensor, handed to the model as a 4-D mask (B, 1, q, P + T)
  so transformers builds none (its mask code inspects the data, a host sync a graph cannot hold);
- the step counter, positions and `finished` flags live on the device and are updated in place;
- whether every row has stopped is read every `stop_check_every` steps (one host sync each), not at every step; the
  extra steps after the last stop only write padding;
- left-padding query rows attend to themselves during prefill (a fully masked row would make SDPA return NaN, which
  would then sit in the cache); no real token ever attends to them.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from transformers import StaticCache

from lmppo.models.loading import hf_model, position_ids_from_mask
from lmppo.sampling.noise import gumbel_argmax


def supports_static_decoding(model: nn.Module) -> bool:
    """Whether `StaticDecoder` can run this (unwrapped HF) model: a decoder whose forward takes `cache` (transformers
    5.2x), `position_ids` and `logits_to_keep`, built for static caches, with SDPA attention (the 4-D bool mask)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    params = inspect.signature(model.forward).parameters
    return (
        all(name in params for name in ("cache", "position_ids", "logits_to_keep"))
        and getattr(model, "_can_compile_fullgraph", False)
        and getattr(config, "_attn_implementation", None) == "sdpa"
    )


class StaticDecoder:
    """Buffers for decoding a batch of `batch` prompts of `prompt_len` tokens into at most `max_new_tokens` tokens.

    `prefill(...)` resets every buffer in place and samples token 0; `step()` feeds the last token and samples the
    next one, reading and writing only these buffers (the body a CUDA graph captures). Reused across rollouts."""

    def __init__(
        self,
        model: nn.Module,
        batch: int,
        prompt_len: int,
        max_new_tokens: int,
        temperature: float,
        stop_ids: torch.Tensor,
        pad_id: int,
        device: torch.device,
    ):
        self.model, self.batch, self.prompt_len, self.max_new_tokens = model, batch, prompt_len, max_new_tokens
        self.temperature, self.pad_id = float(temperature), int(pad_id)
        length = prompt_len + max_new_tokens
        self.cache = StaticCache(config=hf_model(model).config, max_cache_len=length)
        self.stop = stop_ids.to(device=device, dtype=torch.long)  # (S,)
        self.mask = torch.zeros(batch, length, dtype=torch.bool, device=device)  # (B, P + T) attended columns
        self.token = torch.zeros(batch, dtype=torch.long, device=device)  # (B,) last sampled token
        self.position = torch.zeros(batch, dtype=torch.long, device=device)  # (B,) position of the next fed token
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)  # (B,)
        self.step_index = torch.zeros((), dtype=torch.long, device=device)  # index of the next token to sample
        self.tokens = torch.full((batch, max_new_tokens), self.pad_id, dtype=torch.long, device=device)  # (B, T)
        self.seeds = torch.zeros(batch, dtype=torch.long, device=device)  # (B,) response seeds

    @torch.no_grad()
    def prefill(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seeds: torch.Tensor, finished: torch.Tensor
    ) -> None:
        """Reset the buffers, run the (B, P) left-padded prompts through the model in one batch, sample token 0.
        `finished` (B,) bool marks rows that must produce only padding (the filler rows of a batch bucket)."""
        B, P = prompt_ids.shape
        assert (B, P) == (self.batch, self.prompt_len), ((B, P), (self.batch, self.prompt_len))
        self.cache.reset()
        self.mask.zero_()
        self.mask[:, :P].copy_(prompt_mask)
        self.tokens.fill_(self.pad_id)
        self.step_index.zero_()
        self.finished.copy_(finished)
        self.seeds.copy_(seeds)
        positions = position_ids_from_mask(prompt_mask)  # (B, P)
        self.position.copy_(positions[:, -1] + 1)
        causal = torch.ones(P, P, dtype=torch.bool, device=prompt_ids.device).tril()
        attend = causal[None] & prompt_mask[:, None, :]  # (B, P, P): key j visible to query i
        attend |= torch.eye(P, dtype=torch.bool, device=prompt_ids.device)[None]  # padding rows see themselves
        full = torch.zeros(B, 1, P, self.mask.shape[1], dtype=torch.bool, device=prompt_ids.device)
        full[:, 0, :, :P] = attend
        out = self.model(
            input_ids=prompt_ids, attention_mask=full, position_ids=positions, cache=self.cache, use_cache=True,
            logits_to_keep=1,
        )  # fmt: skip
        self._choose(out.logits[:, -1])

    def step(self) -> None:
        """Feed the last token, sample the next: fixed shapes, device tensors only, no host sync."""
        out = self.model(
            input_ids=self.token[:, None],
            attention_mask=self.mask[:, None, None, :],
            position_ids=self.position[:, None],
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.position.add_(1)
        self._choose(out.logits[:, -1])

    def _choose(self, logits: torch.Tensor) -> None:
        """Sample token `step_index` from (B, V) logits; record it, its stop flag and its mask column."""
        token = gumbel_argmax(logits, self.temperature, self.seeds, self.step_index)
        token = torch.where(self.finished, torch.full_like(token, self.pad_id), token)
        index = self.step_index.view(1)
        self.tokens.index_copy_(1, index, token[:, None])
        self.finished |= (token[:, None] == self.stop[None, :]).any(-1)
        self.mask.index_copy_(1, index + self.prompt_len, (~self.finished)[:, None])
        self.token.copy_(token)
        self.step_index.add_(1)


def decode(
    decoder: StaticDecoder, stop_check_every: int, replay: Optional[Callable[[], None]] = None
) -> tuple[torch.Tensor, int]:
    """Run the decoding steps after `prefill`: `replay()` (a captured graph) or `decoder.step()` per token, checking
    every `stop_check_every` steps whether all rows have stopped. Returns the (B, T) tokens and the steps taken."""
    run = replay or decoder.step
    taken = 1  # token 0 came from the prefill
    while taken < decoder.max_new_tokens:
        if taken % stop_check_every == 0 and bool(decoder.finished.all()):
            break
        run()
        taken += 1
    return decoder.tokens, taken


def pad_batch(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seeds: torch.Tensor, batch: int, prompt_len: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad prompts to `prompt_len` columns and add filler rows up to `batch` (a filler row: padding with its
    last column attended, finished from the start). Returns ids, mask, seeds and the initial `finished` flags."""
    B, P = prompt_ids.shape
    device = prompt_ids.device
    ids = torch.full((batch, prompt_len), pad_id, dtype=prompt_ids.dtype, device=device)
    mask = torch.zeros(batch, prompt_len, dtype=torch.bool, device=device)
    ids[:B, prompt_len - P :] = prompt_ids
    mask[:B, prompt_len - P :] = prompt_mask
    mask[B:, -1] = True
    all_seeds = torch.zeros(batch, dtype=torch.long, device=device)
    all_seeds[:B] = seeds
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    finished[B:] = True
    return ids, mask, all_seeds, finished


def round_up(n: int, sizes: Sequence[int], multiple: int) -> int:
    """The smallest of `sizes` that holds n, else n rounded up to a multiple of `multiple`."""
    for size in sizes:
        if n <= size:
            return size
    return -(-n // multiple) * multiple
