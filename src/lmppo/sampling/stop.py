"""The stop token of a run (`rollout.stop_token`) as token ids, resolved one way for training and evaluation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from lmppo.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def stop_token_ids(
    stop: str, tokenizer: PreTrainedTokenizerBase, device: Optional[torch.device] = None
) -> torch.Tensor:
    """(S,) the ids of `rollout.stop_token`: `eos` the tokenizer's eos ids, `none` no stop token, otherwise a token
    of the tokenizer (its name, e.g. `<|im_end|>`, or a text that encodes to exactly one token)."""
    if stop == "none":
        ids: list[int] = []
    elif stop == "eos":
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ConfigError("rollout.stop_token", stop, "the tokenizer has no eos token; name a token string")
        ids = [eos] if isinstance(eos, int) else list(eos)
    else:
        found = tokenizer.convert_tokens_to_ids(stop)  # one token's id for one token string
        tid = found if isinstance(found, int) else None
        if tid is None or tid == tokenizer.unk_token_id:
            encoded = tokenizer.encode(stop, add_special_tokens=False)
            if len(encoded) != 1:
                raise ConfigError(
                    "rollout.stop_token",
                    stop,
                    f"is not a single token of this tokenizer (it encodes to {len(encoded)} tokens)",
                )
            tid = encoded[0]
        ids = [tid]
    return torch.tensor(ids, dtype=torch.long, device=device)
