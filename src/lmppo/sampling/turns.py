"""Sampling that continues: the turns of a batch of multi-turn episodes, token in, token out.

A `TurnSampler` samples the first turn of every episode from its prompt, then, turn after turn, the next turn of
the episodes still going after their observation's token ids are appended. Nothing is decoded and re-encoded: the
history is exactly the ids sampled and the ids appended.

- `CachedTurns` (the native engine): one KV cache for the batch lives across turns; each turn feeds only the new
  tokens (the previous turn's last token and the observation) and keeps decoding. Rows whose episode ended stay in
  the batch with their new positions masked.
- `RepeatedPrefill` (any engine, e.g. `hf`, `vllm`): each turn calls the engine's `sample` on the whole history, so
  the history is encoded again every turn: about turns x (history length) prefill tokens per episode instead of its
  length (vLLM's prefix cache takes most of that back; `hf` pays it).

Turn k (from 0) of response b is sampled with the seed `response_seed(seed_b, k, 0)` for k > 0 and seed_b itself for
k = 0, so the first turn is exactly the single-turn response and every turn's tokens depend only on its seed and
history, never on the other rows.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import torch
from torch import nn

from lmppo.models.loading import hf_model
from lmppo.sampling.native import _accepts_logits_to_keep, _cache_argument, _cache_of, response_seed
from lmppo.sampling.noise import gumbel_argmax, seed_tensor

Turn = list[list[int]]
"""Each row's tokens of one turn (up to and including its stop token; [] for a row not sampled)."""


def turn_seeds(seeds: Sequence[int], turn: int) -> list[int]:
    """The seeds of turn `turn` (from 0) of responses seeded `seeds`."""
    return list(seeds) if turn == 0 else [response_seed(s, turn, 0) for s in seeds]


class TurnSampler(Protocol):
    def first(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int]) -> Turn:
        """The first turn of each episode from its prompt ids."""
        ...

    def next(self, observations: Sequence[Optional[Sequence[int]]], turn: int) -> Turn:
        """Turn `turn` of each episode after its observation ids (None: the episode has ended, nothing sampled)."""
        ...


def _split_rows(tokens: torch.Tensor, sampled: torch.Tensor) -> Turn:
    """(B, T) tokens and (B, T) bool sampled flags -> each row's sampled tokens."""
    return [row[keep].tolist() for row, keep in zip(tokens.cpu(), sampled.cpu())]


class CachedTurns:
    """Turns from one KV cache kept across the episode (`rollout.backend: native`, the dynamic decoding loop)."""

    def __init__(self, model: nn.Module, temperature: float, max_new_tokens: int, stop_ids: torch.Tensor, pad_id: int):
        self.model = hf_model(model)
        self.temperature, self.max_new_tokens, self.pad_id = temperature, max_new_tokens, pad_id
        self.keep = {"logits_to_keep": 1} if _accepts_logits_to_keep(self.model) else {}
        self.cache_argument = _cache_argument(self.model)
        self.device = next(self.model.parameters()).device
        self.stop = stop_ids.to(self.device)
        self.past: object = None
        self.attention = torch.zeros(0, 0, dtype=torch.long)  # (B, L) 1 where the cache holds a real token
        self.next_position = torch.zeros(0, dtype=torch.long)  # (B,) position of each row's next real token
        self.pending = torch.zeros(0, dtype=torch.long)  # (B,) each row's last sampled token, not yet in the cache
        self.pending_real = torch.zeros(0, dtype=torch.bool)  # (B,) whether it was sampled in the last turn
        self.seeds: list[int] = []

    @torch.no_grad()
    def first(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int]) -> Turn:
        B = len(prompts)
        self.seeds = list(seeds)
        self.attention = torch.zeros(B, 0, dtype=torch.long, device=self.device)
        self.next_position = torch.zeros(B, dtype=torch.long, device=self.device)
        self.past = None
        logits = self._feed([list(p) for p in prompts])
        return self._sample_turn(logits, torch.ones(B, dtype=torch.bool, device=self.device), 0)

    @torch.no_grad()
    def next(self, observations: Sequence[Optional[Sequence[int]]], turn: int) -> Turn:
        active = torch.tensor([o is not None for o in observations], device=self.device)
        pending, real = self.pending.tolist(), self.pending_real.tolist()
        blocks = [
            ([pending[b]] if real[b] else []) + list(o) if o is not None else [] for b, o in enumerate(observations)
        ]
        logits = self._feed(blocks)
        return self._sample_turn(logits, active, turn)

    def _feed(self, blocks: list[list[int]]) -> torch.Tensor:
        """Append each row's block (left-padded to one width, padding masked) to the cache; (B, V) next logits."""
        width = max(1, max(len(b) for b in blocks))
        ids = torch.full((len(blocks), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(blocks), width, dtype=torch.long)
        for i, block in enumerate(blocks):
            if block:
                ids[i, width - len(block) :] = torch.as_tensor(block)
                mask[i, width - len(block) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = self.next_position[:, None] + (mask.cumsum(1) - 1).clamp(min=0)  # (B, W) over real tokens
        self.attention = torch.cat([self.attention, mask], dim=1)
        self.next_position = self.next_position + mask.sum(1)
        return self._forward(ids, positions)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cache = {self.cache_argument: self.past} if self.past is not None else {}
        out = self.model(
            input_ids=ids, attention_mask=self.attention, position_ids=positions, use_cache=True, **cache, **self.keep
        )
        self.past = _cache_of(out)
        return out.logits[:, -1]

    def _sample_turn(self, logits: torch.Tensor, active: torch.Tensor, turn: int) -> Turn:
        """Decode one turn for the `active` rows (B,) bool; the last token of each stays pending (fed with the next
        observation, so a turn costs one forward pass per token and no extra one at its end)."""
        seeds = seed_tensor(turn_seeds(self.seeds, turn), self.device)
        alive, tokens, sampled = active.clone(), [], []
        for step in range(self.max_new_tokens):
            token = gumbel_argmax(logits, self.temperature, seeds, step)
            token = torch.where(alive, token, torch.full_like(token, self.pad_id))
            tokens.append(token)
            sampled.append(alive.clone())
            real = alive
            alive = alive & ~(token[:, None] == self.stop[None, :]).any(-1)
            if step == self.max_new_tokens - 1 or not bool(alive.any()):
                self.pending, self.pending_real = token, real
                break
            self.attention = torch.cat([self.attention, real.long()[:, None]], dim=1)
            logits = self._forward(token[:, None], self.next_position[:, None])
            self.next_position = self.next_position + real.long()
        return _split_rows(torch.stack(tokens, 1), torch.stack(sampled, 1))


class RepeatedPrefill:
    """Turns from an engine's one-shot `sample(prompt ids, seeds) -> (response_ids, response_mask, ...)` called on
    each episode's whole history (ids, never text) every turn."""

    def __init__(self, sample: Callable[[list[list[int]], list[int]], tuple[torch.Tensor, ...]]):
        self.sample = sample
        self.history: list[list[int]] = []
        self.seeds: list[int] = []

    def first(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int]) -> Turn:
        self.history, self.seeds = [list(p) for p in prompts], list(seeds)
        return self._turn(list(range(len(prompts))), 0)

    def next(self, observations: Sequence[Optional[Sequence[int]]], turn: int) -> Turn:
        rows = [b for b, o in enumerate(observations) if o is not None]
        for b in rows:
            self.history[b].extend(observations[b] or [])
        return self._turn(rows, turn)

    def _turn(self, rows: list[int], turn: int) -> Turn:
        out: Turn = [[] for _ in self.history]
        if not rows:
            return out
        seeds = turn_seeds([self.seeds[b] for b in rows], turn)
        response_ids, response_mask = self.sample([self.history[b] for b in rows], seeds)[:2]
        for b, tokens in zip(rows, _split_rows(response_ids, response_mask)):
            out[b] = tokens
            self.history[b].extend(tokens)
        return out
