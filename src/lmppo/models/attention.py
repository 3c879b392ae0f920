"""Attention kernel choice for CPU passes under bf16 autocast.

Design notes: docs/design.md, `lmppo.models.attention`."""

from __future__ import annotations

import torch
from torch import nn

IMPLEMENTATION = "lmppo_cpu"
EAGER_MAX_SCORES = 256 * 256  # query length x key length per head up to which eager wins on CPU in bf16


def _attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs
):
    """query: (B, heads, Lq, D); key, value: (B, kv_heads, Lk, D) -> ((B, Lq, heads, D), weights or None)."""
    low_precision = query.dtype in _LOW_PRECISION or (
        query.device.type == "cpu"
        and torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") in _LOW_PRECISION
    )
    short = query.shape[2] * key.shape[2] <= EAGER_MAX_SCORES
    plain = not any(kwargs.get(k) is not None for k in _UNSUPPORTED)
    if query.device.type == "cpu" and low_precision and short and plain:
        return eager_attention(
            query,
            key,
            value,
            attention_mask,
            kwargs.get("scaling"),
            kwargs.get("dropout", 0.0) if module.training else 0.0,
        )
    return _SDPA[0](module, query, key, value, attention_mask, **kwargs)


_SDPA: list = []  # transformers' SDPA attention function, looked up once by _register (not per layer call)
_LOW_PRECISION = (torch.bfloat16, torch.float16)
# keyword arguments of model-specific attention variants that the eager path below does not implement
_UNSUPPORTED = ("softcap", "s_aux", "sinks", "head_mask")


def eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
):
    """softmax(q k^T * scaling + mask) v, the softmax in fp32. attention_mask: additive, broadcastable to
    (B, heads, Lq, Lk). Grouped key/value heads are repeated to the query heads.
    Returns ((B, Lq, heads, D) output, (B, heads, Lq, Lk) attention probabilities)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, heads, Lq, Lk)
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout:
        probs = nn.functional.dropout(probs, p=dropout, training=True)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    _SDPA[:] = [sdpa_attention_forward]
    AttentionInterface.register(IMPLEMENTATION, _attention)
    AttentionMaskInterface.register(IMPLEMENTATION, eager_mask)


def use_cpu_attention(model: nn.Module) -> nn.Module:
    """Switch an HF model that uses SDPA attention to `lmppo_cpu` (a no-op for other implementations, such as
    flash-attention chosen by the user, and for models that cannot switch). Returns the model."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return model
    if not getattr(model, "_supports_attention_backend", False):
        return model  # attention not dispatched through AttentionInterface: nothing to switch
    _register()
    model.set_attn_implementation(IMPLEMENTATION)
    return model
