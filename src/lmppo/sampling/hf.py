"""The `hf` sampling engine's parts (`lmppo.sampling.engines.HFEngine`): honest sampling with transformers' `generate`.

Honest sampling: the logprobs used for the PPO ratio and the KL describe the distribution that was sampled.
Generation is pure sampling at `temperature`:
- every setting that bends the distribution is passed at its neutral value (transformers would otherwise fill
  an unset one from its global defaults, e.g. top_k = 50);
- the model's own `generation_config` (checkpoints often ship top_k, top_p or a repetition penalty, and
  transformers 5 merges its values into the config passed to `generate`) is replaced by a neutral one for the
  duration of each `generate` call, and restored afterwards so the saved model keeps its own defaults;
- `pure_sampling_config` checks the result once with a two-token probe: the scores transformers samples from must
  equal the raw logits divided by the temperature (this catches any processor a future transformers adds).
Settings that bend the distribution are refused unless the user opts in (see `check_generation_kwargs`).
"""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch
from torch import nn

from lmppo.config.sampling_settings import (  # noqa: F401  (re-exported: the settings lmppo.sampling.hf applies)
    ALLOWED_SETTINGS,
    DISTORTING_SETTINGS,
    WHY_DISTORTING,
    check_generation_kwargs,
)
from lmppo.core.masking import stop_token_mask
from lmppo.errors import LmppoError

if TYPE_CHECKING:
    from transformers import GenerationConfig


def pure_sampling_config(
    model: nn.Module,
    temperature: float,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_id: int,
    extra: Optional[dict] = None,
) -> GenerationConfig:
    """A GenerationConfig for pure sampling at `temperature` (plus the user's `extra` settings, already checked
    by `check_generation_kwargs`). Unless `extra` bends the distribution on purpose, a two-token probe with
    `model` verifies that transformers samples from softmax(logits / temperature) (see `verify_pure_sampling`)."""
    from transformers import GenerationConfig

    settings = dict(DISTORTING_SETTINGS)
    settings.update(extra or {})
    gen = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(stop_ids) or None,
        pad_token_id=pad_id,
        use_cache=True,
        **settings,
    )
    if not any(settings[k] != v for k, v in DISTORTING_SETTINGS.items()):
        verify_pure_sampling(model, gen)
    return gen


@contextmanager
def neutral_generation_config(model: nn.Module, gen_config: GenerationConfig) -> Iterator[None]:
    """Inside the block the model's own generation_config holds only the stop and pad ids, so none of its
    sampling defaults can be merged into `gen_config` by `generate`; the original is restored afterwards."""
    from transformers import GenerationConfig

    original = getattr(model, "generation_config", None)
    neutral = GenerationConfig(eos_token_id=gen_config.eos_token_id, pad_token_id=gen_config.pad_token_id)
    setattr(model, "generation_config", neutral)  # a transformers model's attribute, not an nn.Module's
    try:
        yield
    finally:
        setattr(model, "generation_config", original)


@torch.no_grad()
def verify_pure_sampling(model: nn.Module, gen_config: GenerationConfig) -> None:
    """Generate two tokens with `gen_config` and check the scores transformers samples from are exactly the raw
    logits / temperature (no top-k/top-p mask, no penalty, no forced or suppressed token). Raises LmppoError
    naming the offending tokens otherwise. The global RNG is left untouched."""
    probe = copy.deepcopy(gen_config)
    probe.max_new_tokens = 2
    probe.output_scores = probe.output_logits = probe.return_dict_in_generate = True
    device = next(model.parameters()).device
    ids = torch.arange(1, 5, device=device)[None]  # a few distinct tokens: a repetition penalty would show
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), neutral_generation_config(model, probe):
        out = getattr(model, "generate")(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=probe)
    temperature = gen_config.temperature or 1.0
    for step, (scores, logits) in enumerate(zip(out.scores, out.logits)):
        expected = logits.float() / temperature
        if not torch.allclose(scores.float(), expected, rtol=1e-4, atol=1e-4):
            bad = (scores.float() - expected).abs().flatten().topk(3).indices.tolist()
            raise LmppoError(
                f"transformers' generate does not sample from softmax(logits / {temperature}) with lmppo's pure "
                f"sampling config (step {step}: tokens {bad} have scores {scores.flatten()[bad].tolist()} instead "
                f"of {expected.flatten()[bad].tolist()}); a logits processor is active that lmppo does not "
                "neutralise. Please report this with your transformers version."
            )


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """List of id lists -> (B, P) ids and (B, P) bool mask, padded on the left."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, s in enumerate(sequences):
        if len(s):
            ids[i, width - len(s) :] = torch.as_tensor(list(s), dtype=torch.long)
            mask[i, width - len(s) :] = True
    return ids, mask


def trim_padding(response_ids: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop trailing columns that are padding in every row."""
    width = int(response_mask.sum(1).max().item()) if response_mask.numel() else 0
    return response_ids[:, : max(width, 1)], response_mask[:, : max(width, 1)]


@torch.no_grad()
def sample_responses(
    policy: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    gen_config: GenerationConfig,
    stop_ids: torch.Tensor,
    max_new_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Generate one response per prompt.

    Returns response_ids (B, T) with padding after the first stop token, response_mask (B, T) bool,
    terminated (B,) bool (stop token produced) and truncated (B,) bool (hit max_new_tokens without it).
    """
    with neutral_generation_config(policy, gen_config):
        generate = getattr(policy, "generate")  # a transformers (or peft) model's, not an nn.Module's
        out = generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(), generation_config=gen_config)
    response_ids = out[:, prompt_ids.shape[1] :]
    response_mask, terminated = stop_token_mask(response_ids, stop_ids)
    response_ids = torch.where(response_mask, response_ids, torch.full_like(response_ids, gen_config.pad_token_id))
    response_ids, response_mask = trim_padding(response_ids, response_mask)
    lengths = response_mask.sum(1)
    truncated = ~terminated & (lengths >= max_new_tokens)
    return response_ids, response_mask, terminated, truncated


def warn_distorting_once(settings: list[str]) -> None:
    if settings:
        warnings.warn(
            f"rollout.generation_kwargs {settings} bend the sampled distribution; KL and PPO ratios "
            "are biased (allowed by rollout.allow_distorting_sampling). The run's metrics carry "
            "`rollout/distorting_sampling` = 1.",
            stacklevel=2,
        )
