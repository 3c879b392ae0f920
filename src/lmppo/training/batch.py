"""The Rollout: what one iteration's sampling produced, one tensor per field.

Position convention (used everywhere in lmppo): index t of every (B, T) field is response token t.
``logprobs[:, t]`` is log pi(response[t] | prompt, response[:t]); ``values[:, t]`` is V of the state in which
token t was chosen; ``rewards[:, t]`` is the reward received for emitting token t. Positions with
``response_mask == False`` (after the stop token) hold padding and never influence any result.
Every response is an episode (a single response: of one turn); a multi-turn episode's response is its turns with
the environment's observations between them (all real tokens); ``action_mask`` marks the policy's tokens, the only
ones trained on (``policy_mask``). The tensors are the rollout's own fields; what is not a tensor (texts,
transcripts, stop reasons) and the turns are read from the road's `episodes` it holds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Optional

import torch

from lmppo.episodes.road import Episodes


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # (B, P) long, left-padded prompts (an episode: its opening)
    prompt_mask: torch.Tensor  # (B, P) bool, True on real prompt tokens
    response_ids: torch.Tensor  # (B, T) long, right-padded responses (padding after the stop token)
    response_mask: torch.Tensor  # (B, T) bool, True on real response tokens (stop token included)
    action_mask: torch.Tensor  # (B, T) bool, True on the policy's tokens (a single response: its response mask)
    logprobs: torch.Tensor  # (B, T) float, log pi_old(a_t|s_t) at the sampling temperature
    ref_logprobs: torch.Tensor  # (B, T) float, log pi_ref(a_t|s_t) at the sampling temperature
    values: torch.Tensor  # (B, T) float, V_old(s_t)
    final_values: torch.Tensor  # (B,) float, V_old of the state after the last real response token
    terminated: torch.Tensor  # (B,) bool, the response ended with the stop token (an episode: the environment)
    truncated: torch.Tensor  # (B,) bool, the response hit max_new_tokens without the stop token (or a budget)
    group_ids: torch.Tensor  # (B,) long, position of the response's prompt in the global batch (same prompt, same id)
    episodes: Episodes  # the road's episodes, held: their prompts, turns (turn ends and rewards) and side
    #                     information (completions, transcripts, stop reasons, tool counts); `lmppo.episodes.road`
    prompts_shown: list[str]  # B prompts as a person wrote them (for tables)
    entropy: Optional[torch.Tensor] = field(default=None)  # (B, T) policy entropy per position (log.token_stats)
    ref_logits: Optional[torch.Tensor] = field(default=None)  # (B, T, V) reference logits / temperature (full_logits)
    full_logits_kl: Optional[torch.Tensor] = field(default=None)  # (B, T) KL(pi_old || pi_ref) of each state
    #                                                  (a `kl.estimator` with the trait `full_logits`: `exact`)

    @property
    def batch_size(self) -> int:
        return self.response_ids.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        """(B, P + T) prompt followed by response."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """(B, P + T) bool, real tokens of prompt and response."""
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def policy_mask(self) -> torch.Tensor:
        """(B, T) bool, the tokens the policy chose (`action_mask`)."""
        return self.action_mask

    @property
    def response_lengths(self) -> torch.Tensor:
        """(B,) number of real response tokens."""
        return self.response_mask.sum(dim=1)

    def select(self, index: torch.Tensor | list[int], device_index: Optional[torch.Tensor] = None) -> "Rollout":
        """The rollout restricted to rows `index` (tensors indexed, text lists picked). `device_index`: the same rows
        as a tensor on the tensors' device, when the caller has it (no copy of the index per field)."""
        idx = index.tolist() if isinstance(index, torch.Tensor) else list(index)
        on_device = {} if device_index is None else {device_index.device: device_index}
        host = torch.as_tensor(idx, dtype=torch.long)
        picked = copy.copy(self)
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                if v.device not in on_device:
                    on_device[v.device] = host.to(v.device)
                setattr(picked, f.name, v[on_device[v.device]])
            elif isinstance(v, list):
                setattr(picked, f.name, [v[i] for i in idx])
        picked.episodes = self.episodes.select(idx, device_index)
        return picked

    def rows(self, start: int, stop: int) -> "Rollout":
        """Rows start .. stop - 1: tensors as views, text lists sliced."""
        picked = copy.copy(self)
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (torch.Tensor, list)):
                setattr(picked, f.name, v[start:stop])
        picked.episodes = self.episodes.rows(start, stop)
        return picked
