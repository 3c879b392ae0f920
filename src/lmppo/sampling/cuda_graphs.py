"""The native sampler's decoding step captured in CUDA graphs (CUDA only; the CPU runs the same step eagerly).

A decoding step of a 360M model at batch 64 is ~0.3 ms of GPU work but hundreds of kernel launches; replaying a
captured graph launches them all at once. A graph is bound to its tensors' shapes and addresses, so each
(batch bucket, prompt-length bucket, max_new_tokens, temperature, stop ids, pad id) gets its own `StaticDecoder` and
graph, kept across rollouts (the optimizer updates the weights in place, so the graph reads the new weights). Batches
are padded up to a bucket with filler rows (finished from the start) and prompts left-padded to a multiple of 32.
A graph is re-captured when the model's parameters move (their addresses are part of the key) or autocast changes
(the static cache takes the dtype of the first keys written into it).

Autocast's weight-cast cache cannot live inside a graph (the cached casts would be freed when autocast exits), so
warm-up and capture run with `cache_enabled=False`: the casts are recorded as part of the step.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from contextlib import nullcontext
from typing import Callable, Optional

import torch
from torch import nn

from lmppo.sampling.static_decoding import StaticDecoder, decode, pad_batch, round_up

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
PROMPT_MULTIPLE = 32


def capture(step: Callable[[], None], warmup: int = 2) -> "torch.cuda.CUDAGraph":
    """Run `step` `warmup` times on a side stream (lazy allocations, cuBLAS workspaces), then capture one call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def _autocast_state() -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")


def _autocast_without_cache():
    if not torch.is_autocast_enabled("cuda"):
        return nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


class DecodeGraphs:
    """Static decoders with their captured step, by bucket; at most `max_entries` kept (oldest dropped)."""

    def __init__(self, max_entries: int = 4):
        self.max_entries = max_entries
        self.entries: OrderedDict[tuple, tuple[StaticDecoder, Optional["torch.cuda.CUDAGraph"]]] = OrderedDict()
        self.captures = 0  # graphs captured so far (a test and the benchmark read it)

    @torch.no_grad()
    def sample(
        self,
        model: nn.Module,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        seeds: torch.Tensor,
        temperature: float,
        max_new_tokens: int,
        stop_ids: torch.Tensor,
        pad_id: int,
        stop_check_every: int,
    ) -> tuple[torch.Tensor, int]:
        """(B, T) sampled tokens (padding after a row stops) and the steps taken, decoding with a captured step."""
        B, P = prompt_ids.shape
        batch = round_up(B, BATCH_BUCKETS, 64)
        prompt_len = round_up(P, (), PROMPT_MULTIPLE)
        weights = tuple(p.data_ptr() for p in model.parameters())
        key = (id(model), hash(weights), batch, prompt_len, max_new_tokens, float(temperature)) + (
            tuple(stop_ids.tolist()),
            int(pad_id),
            _autocast_state(),  # the cache's dtype follows autocast
        )
        inputs = pad_batch(prompt_ids, prompt_mask, seeds, batch, prompt_len, pad_id)
        with _autocast_without_cache():
            if key in self.entries:
                self.entries.move_to_end(key)
                decoder, graph = self.entries[key]
                decoder.prefill(*inputs)
            else:
                decoder = StaticDecoder(
                    model, batch, prompt_len, max_new_tokens, temperature, stop_ids, pad_id, prompt_ids.device
                )
                decoder.prefill(*inputs)  # allocates the cache before capture
                try:
                    graph = capture(decoder.step)
                    self.captures += 1
                except RuntimeError as err:  # a model whose step cannot be captured: decode it eagerly
                    warnings.warn(f"lmppo: the decoding step could not be captured in a CUDA graph ({err}); eager")
                    graph = None
                decoder.prefill(*inputs)  # warm-up and capture advanced the buffers: start again
                self.entries[key] = (decoder, graph)
                while len(self.entries) > self.max_entries:
                    self.entries.popitem(last=False)
        tokens, taken = decode(decoder, stop_check_every, graph.replay if graph is not None else None)
        return tokens[:B].clone(), taken


def static_sample(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    seeds: torch.Tensor,
    temperature: float,
    max_new_tokens: int,
    stop_ids: torch.Tensor,
    pad_id: int,
    stop_check_every: int,
    graphs: Optional[DecodeGraphs] = None,
) -> tuple[torch.Tensor, int]:
    """Static decoding: through `graphs` on CUDA when given, otherwise eagerly with a decoder built for this call."""
    if graphs is not None and prompt_ids.device.type == "cuda":
        return graphs.sample(
            model, prompt_ids, prompt_mask, seeds, temperature, max_new_tokens, stop_ids, pad_id, stop_check_every
        )
    B, P = prompt_ids.shape
    decoder = StaticDecoder(model, B, P, max_new_tokens, temperature, stop_ids, pad_id, prompt_ids.device)
    with torch.no_grad():
        decoder.prefill(prompt_ids, prompt_mask, seeds, torch.zeros(B, dtype=torch.bool, device=prompt_ids.device))
        return decode(decoder, stop_check_every)
