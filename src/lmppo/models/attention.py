"""Attention kernel choice for CPU passes under bf16 autocast.

Design notes: docs/design.md, `lmppo.models.attention`."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Optional

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


# ----------------------------------------------------------------------------- padding decided on the host
_PADDED: ContextVar[Optional[bool]] = ContextVar("lmppo_padded", default=None)
_SDPA_MASK: list = []  # transformers' own SDPA mask builder, wrapped by `_sdpa_mask_known_padding`


def _sdpa_mask_known_padding(*args, **kwargs):
    """transformers' SDPA mask, except that inside `padding_known(True/False)` it does not read the 2D mask to
    decide whether SDPA's `is_causal` can replace it (a host sync per forward): the caller said."""
    padded = _PADDED.get()
    if padded is None or args:
        return _SDPA_MASK[0](*args, **kwargs)
    from transformers.masking_utils import causal_mask_function

    q_offset = kwargs.get("q_offset", 0)
    plain_causal = (
        kwargs.get("mask_function", causal_mask_function) is causal_mask_function
        and kwargs.get("local_size") is None
        and isinstance(q_offset, int)
        and q_offset == 0
        and kwargs["q_length"] == kwargs["kv_length"]
        and kwargs.get("allow_is_causal_skip", True)
    )
    if plain_causal and not padded:
        return None  # what transformers returns for a mask without padding: SDPA's is_causal
    return _SDPA_MASK[0](*args, **{**kwargs, "allow_is_causal_skip": False})


@contextmanager
def padding_known(padded: Optional[bool]) -> Iterator[None]:
    """Forward passes inside see whether their attention mask holds padding from the caller (`padded`; None:
    transformers reads the mask, as usual). The SDPA mask then never costs a host sync; the eager mask never did."""
    if padded is not None and not _SDPA_MASK:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        _SDPA_MASK[:] = [sdpa_mask]
        AttentionMaskInterface.register("sdpa", _sdpa_mask_known_padding)
    token = _PADDED.set(padded)
    try:
        yield
    finally:
        _PADDED.reset(token)
