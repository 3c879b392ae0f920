"""Reference policies for the KL penalty.

Design notes: docs/design.md, `lmppo.models.reference`."""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, contextmanager
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from lmppo.core.logprobs import selective_log_softmax
from lmppo.errors import CheckpointError, ConfigError
from lmppo.models.loading import hf_model, is_peft_model, policy_forward
from lmppo.models.partition import gathered_if_partitioned, is_partitioned, local_shard

REFERENCE_MODES = ("frozen", "base", "sync", "ema")


def adapters_disabled(policy: nn.Module) -> AbstractContextManager[None]:
    """A peft model's `disable_adapter()`: inside the block it computes its base model (the adapters off)."""
    disable: Callable[[], AbstractContextManager[None]] = getattr(policy, "disable_adapter")  # typed for nn.Module
    return disable()


def trained_parameters(policy: nn.Module) -> dict[str, nn.Parameter]:
    """name -> parameter for every parameter of the policy that training changes (requires_grad)."""
    return {name: p for name, p in policy.named_parameters() if p.requires_grad}


class ReferencePolicy:
    """The reference pi_ref of the KL penalty, kept in step with the policy according to `mode`.

    `logprobs` gives log pi_ref of given responses; `after_iteration` moves the reference after an iteration
    when the schedule says so; `state_dict` / `load_state_dict` carry it through checkpoints.
    """

    def __init__(
        self,
        policy: nn.Module,
        mode: str = "frozen",
        every: int = 10,
        ema_alpha: float = 0.1,
        model: Optional[nn.Module] = None,
    ):
        """`model`: the reference's weights when built elsewhere (ZeRO-3: `lmppo.distributed.zero`); default a copy."""
        if mode not in REFERENCE_MODES:
            raise ConfigError("reference.mode", mode, "must be one of " + ", ".join(f"`{m}`" for m in REFERENCE_MODES))
        self.mode, self.every, self.ema_alpha = mode, every, ema_alpha
        self.peft = is_peft_model(policy)
        self.model: Optional[nn.Module] = None  # full copy of the reference weights (no LoRA)
        self.adapter: dict[str, torch.Tensor] = {}  # reference adapter: name -> detached copy (LoRA)
        self._fingerprint: Optional[list[float]] = None
        self.initial_is_base = True  # `base`: the policy as it starts equals its base (a fresh LoRA adapter)
        if mode == "base" and (not self.peft or model is not None):
            raise ConfigError(
                "reference.mode",
                mode,
                "is the base model under a LoRA policy's adapters: it needs a LoRA policy (model.lora.enabled, or "
                "a PEFT adapter folder as model.policy) and no ref_model object",
            )
        if mode == "base":
            self.initial_is_base = _adapter_off_is_identity(policy)
        elif not self.peft or model is not None:  # (a reference model given for a LoRA policy is used as given)
            self.model = model if model is not None else copy.deepcopy(hf_model(policy))
            self.model.requires_grad_(False)
            self.model.eval()
        elif mode != "frozen" or not _adapter_off_is_identity(policy):
            self.adapter = {name: p.detach().clone() for name, p in trained_parameters(policy).items()}

    @property
    def adapter_off(self) -> bool:
        """True when the reference is the policy with its adapters switched off (LoRA, `frozen`)."""
        return self.peft and self.model is None and not self.adapter

    def logprobs(
        self,
        policy: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_len: int,
        response_ids: torch.Tensor,
        temperature: float,
    ) -> torch.Tensor:
        """(B, T) log pi_ref(response_t | prefix) at the sampling temperature.

        input_ids / attention_mask: (B, P + T) prompt and response; response_ids: (B, T)."""
        return selective_log_softmax(
            self.logits(policy, input_ids, attention_mask, prompt_len, temperature), response_ids
        )

    def logits(
        self,
        policy: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_len: int,
        temperature: float,
    ) -> torch.Tensor:
        """(B, T, V) the reference's next-token logits at the response positions, divided by the temperature."""
        if self.model is not None:
            return policy_forward(self.model, input_ids, attention_mask, prompt_len, temperature).logits
        with self.as_reference(policy):
            return policy_forward(policy, input_ids, attention_mask, prompt_len, temperature).logits

    @contextmanager
    def as_reference(self, policy: nn.Module) -> Iterator[None]:
        """LoRA only: inside the block `policy` computes the reference (adapters off, or the reference adapter
        swapped in); its own trained parameters are restored bit for bit on the way out."""
        if self.adapter_off:
            with adapters_disabled(policy):
                yield
            return
        params = trained_parameters(policy)
        saved = {}
        with torch.no_grad():
            for name, ref in self.adapter.items():
                param = params[name]
                if ref.device != param.device:  # built before the policy moved to its device: follow it once
                    ref = self.adapter[name] = ref.to(param.device)
                saved[name] = param.detach().clone()
                param.copy_(ref)
        try:
            yield
        finally:
            with torch.no_grad():
                for name, value in saved.items():
                    params[name].copy_(value)

    @torch.no_grad()
    def after_iteration(self, iteration: int, policy: nn.Module) -> bool:
        """Move the reference towards the policy when the schedule says so; True when it moved.
        `iteration` counts completed iterations from 1: the reference moves after iterations every, 2 * every, ..."""
        if self.mode in ("frozen", "base") or iteration % self.every:
            return False
        if self.model is not None:
            source = dict(hf_model(policy).named_parameters())
            targets = dict(self.model.named_parameters())
        else:
            source, targets = trained_parameters(policy), self.adapter
        for name, ref in targets.items():
            # ZeRO-3: each process updates its own shard (shards of policy and reference line up)
            ref, new = local_shard(ref), local_shard(source[name]).detach().to(ref.device, ref.dtype)
            if self.mode == "sync":
                ref.copy_(new)
            else:
                ref.mul_(1.0 - self.ema_alpha).add_(new, alpha=self.ema_alpha)
        return True

    # ------------------------------------------------------------------ checkpoints
    @property
    def partitioned(self) -> bool:
        """True when ZeRO-3 partitioned the reference model: its state is this process's shards (a checkpoint holds
        one file of them per process)."""
        return self.model is not None and is_partitioned(self.model)

    def state_dict(self) -> dict:
        """What a checkpoint must hold to rebuild this reference exactly (tensors on the CPU).

        `weights`: the reference adapter (LoRA) or, for `sync` / `ema`, the full reference weights. A frozen full
        copy is not stored (it is the initial policy, which resume loads again); its `fingerprint` is, so that a
        resume that rebuilt it from other weights fails loudly instead of measuring the KL to the wrong model.
        """
        state: dict = {"mode": self.mode}
        if self.model is not None and self.mode == "frozen":
            if self._fingerprint is None:  # frozen weights never change: computed once
                self._fingerprint = _fingerprint(self.model.parameters())
            state["fingerprint"] = self._fingerprint
        elif self.partitioned:
            state["weights"] = {k: local_shard(p).detach().cpu().clone() for k, p in self.model.named_parameters()}
        elif self.model is not None:
            state["weights"] = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        elif self.adapter:
            state["weights"] = {k: v.detach().cpu().clone() for k, v in self.adapter.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        if state.get("mode", self.mode) != self.mode:
            raise CheckpointError(
                f"the checkpoint's reference policy has mode `{state['mode']}` but this run has "
                f"reference.mode `{self.mode}`; resume with the same reference.mode"
            )
        if "fingerprint" in state and self.model is not None:
            now = _fingerprint(self.model.parameters())
            if not torch.allclose(torch.tensor(now), torch.tensor(state["fingerprint"]), rtol=1e-6, atol=1e-6):
                raise CheckpointError(
                    "the frozen reference rebuilt on resume differs from the one the checkpoint "
                    "was trained against (weight fingerprint "
                    f"{now} vs {state['fingerprint']}); "
                    "resume from the same initial policy (model.policy)"
                )
        weights = state.get("weights")
        if not weights:
            return
        if self.partitioned:
            self._load_shards(weights)
            return
        if self.model is not None:
            self.model.load_state_dict(weights)
            return
        if set(weights) != set(self.adapter):
            missing = sorted(set(self.adapter) ^ set(weights))[:3]
            raise CheckpointError(
                f"the checkpoint's reference adapter does not match this run's trained parameters "
                f"(e.g. {missing}); resume with the same model.lora settings"
            )
        with torch.no_grad():
            for name, value in weights.items():
                self.adapter[name].copy_(value)

    def _load_shards(self, weights: dict) -> None:
        params = dict(self.model.named_parameters())
        if set(weights) != set(params):
            raise CheckpointError(
                f"the checkpoint's reference shards do not match this run's reference model (e.g. "
                f"{sorted(set(weights) ^ set(params))[:3]})"
            )
        with torch.no_grad():
            for name, value in weights.items():
                shard = local_shard(params[name])
                if shard.shape != value.shape:
                    raise CheckpointError(
                        f"the checkpoint's reference shard `{name}` has shape {tuple(value.shape)}, "
                        f"this process holds {tuple(shard.shape)}; resume with the same number of "
                        "processes"
                    )
                shard.copy_(value)


def _fingerprint(params) -> list[float]:
    """Two float64 numbers that change when any weight changes: sum and sum of squares."""
    total, squares = 0.0, 0.0
    for p in params:
        d = p.detach().double()
        total += d.sum().item()
        squares += (d * d).sum().item()
    return [total, squares]


@torch.no_grad()
def _adapter_off_is_identity(policy: nn.Module) -> bool:
    """Does switching the adapters off reproduce the policy as it is now? (Fresh LoRA: B = 0, so yes.)"""
    device = next(policy.parameters()).device
    ids = torch.arange(8, device=device)[None] % max(hf_model(policy).config.vocab_size, 1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    with gathered_if_partitioned(policy):  # ZeRO-3 loaded the policy partitioned: its full weights for this check
        on = policy_forward(policy, ids, mask, 1, 1.0).logits
        with adapters_disabled(policy):
            off = policy_forward(policy, ids, mask, 1, 1.0).logits
    return torch.equal(on, off)
