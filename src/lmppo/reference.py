"""Reference policies for the KL penalty.

- `frozen` (default): a copy of the initial policy, never trained (the usual RLHF choice, TRL issue #1112).
- `sync`: the copy is overwritten with the policy's weights every `every` iterations.
- `ema`: ref <- (1 - alpha) * ref + alpha * policy every `every` iterations (as TR-DPO does).
- With LoRA: the base model with the adapters switched off; no second copy of the weights exists.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from lmppo.core.logprobs import selective_log_softmax
from lmppo.models import hf_model, policy_forward


class ReferencePolicy:
    def __init__(self, policy: nn.Module, mode: str = "frozen", every: int = 10, ema_alpha: float = 0.1):
        self.mode, self.every, self.ema_alpha = mode, every, ema_alpha
        self.adapter_off = hasattr(policy, "disable_adapter")
        if self.adapter_off and mode != "frozen":
            raise ValueError("with LoRA the reference is the adapter-free base model; only mode `frozen` applies")
        self.model: Optional[nn.Module] = None
        if not self.adapter_off:
            self.model = copy.deepcopy(hf_model(policy))
            self.model.requires_grad_(False)
            self.model.eval()

    def logprobs(self, policy: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                 response_ids: torch.Tensor, temperature: float) -> torch.Tensor:
        """(B, T) log pi_ref(response_t | prefix) at the sampling temperature."""
        if self.adapter_off:
            with policy.disable_adapter():
                logits = policy_forward(policy, input_ids, attention_mask, prompt_len, temperature).logits
        else:
            logits = policy_forward(self.model, input_ids, attention_mask, prompt_len, temperature).logits
        return selective_log_softmax(logits, response_ids)

    @torch.no_grad()
    def after_iteration(self, iteration: int, policy: nn.Module) -> bool:
        """Move the reference towards the policy when the schedule says so; True when it moved.
        `iteration` counts completed iterations from 1."""
        if self.mode == "frozen" or iteration % self.every:
            return False
        source = dict(hf_model(policy).named_parameters())
        for name, ref_param in self.model.named_parameters():
            new = source[name].detach().to(ref_param.dtype)
            if self.mode == "sync":
                ref_param.copy_(new)
            else:
                ref_param.mul_(1.0 - self.ema_alpha).add_(new, alpha=self.ema_alpha)
        return True

    def state_dict(self) -> dict:
        """Reference weights, only when they differ from the initial policy's (not frozen)."""
        if self.mode == "frozen" or self.model is None:
            return {}
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict) -> None:
        if state and self.model is not None:
            self.model.load_state_dict(state)
