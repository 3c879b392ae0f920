"""The reward-source interface: what a source is (`RewardSource`, built from its config section and a
`SourceContext`), the registry decorator, and the names sources get. The kinds live in their own modules
(`functions`, `model`, `http`); building them from a config: `lmppo.rewards.building`; scoring: `lmppo.rewards.scoring`.

Design notes: docs/design.md, `lmppo.rewards.sources`."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal, Optional

from lmppo.config import RewardSourceConfig
from lmppo.registry import REWARD_SOURCES

if TYPE_CHECKING:
    import torch

SpanPlacement = Literal["last", "spread"]
"""`reward.sources[].span_placement` (`lmppo.config.RewardSourceConfig`)."""


@dataclass
class SourceContext:
    """What a source constructor may need besides its own config section."""

    device: str = "cpu"
    """Device for reward models."""
    allow_pickle: bool = False
    """Allow reward-model weights in pickle files (`.bin`, `.pt`)."""
    trust_remote_code: bool = False
    """Allow reward-model folders to run their own code."""
    strict: bool = True
    """Refuse a reward model whose weights do not match its config.json whole (`model.strict`)."""
    batch_size: int = 0
    """Sequences per reward-model forward pass; 0 means the whole batch."""
    dtype: Optional[torch.dtype] = None
    """torch dtype for reward models; None keeps the checkpoint's (float32 for most small models)."""
    autocast_dtype: Optional[torch.dtype] = None
    """Run reward-model forward passes under autocast to this dtype (`torch.bfloat16` with `precision: bf16`,
    like the policy's passes); None: no autocast. Scores are returned in float32 either way."""
    resolve_path: Callable[[str], str] | None = None
    """Turns a model name that is not a folder (`hub:ORG/NAME`, a built-in name) into a local folder."""


class RewardSource:
    """One reward signal: ``source(prompts, completions) -> list`` of one output per response.

    With ``wants_completion_ids`` True it is called as ``source(prompts, completions, completion_ids=ids)``; with
    ``wants_token_ids`` True as ``source(prompts, completions, token_ids=ids)``, each entry the whole sequence of
    policy token ids: the prompt without padding, then the response including its stop token."""

    kind: str = ""
    wants_completion_ids: bool = False
    wants_token_ids: bool = False
    wants_columns: bool = False
    """Called with ``columns=``: per response, its prompt's other columns (a dict)."""
    watch: str = ""
    """Non-empty for a warning-sign metric (higher is worse, e.g. completions collapsing): why to watch it. Tables
    label it so and never call its rise a win; read from a function's ``watch`` attribute."""

    def __init__(self, cfg: RewardSourceConfig, ctx: SourceContext):
        self.cfg = cfg
        self.name = cfg.name or default_name(cfg)
        self.weight = float(cfg.weight)
        self.span_placement = cfg.span_placement

    def __call__(self, prompts: list[str], completions: list[str]) -> list:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, weight={self.weight})"


def register_reward_source(kind: str) -> Callable[[type[RewardSource]], type[RewardSource]]:
    """Class decorator adding a source kind to ``lmppo.registry.REWARD_SOURCES``; a name registered twice is
    refused."""

    def deco(cls: type[RewardSource]) -> type[RewardSource]:
        REWARD_SOURCES.register(kind)(cls)
        cls.kind = kind
        return cls

    return deco


def raised_text(err: BaseException) -> str:
    """`Type: message` of an exception from user code, bounded; SystemExit says it was an exit."""
    if isinstance(err, SystemExit):
        return (
            f"SystemExit (it called sys.exit({err.code!r:.60}) or exit(); user code must return or raise, "
            "not end the process)"
        )
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text if len(text) <= 300 else text[:300] + ' ...'}"


def mask_url(url: str) -> str:
    """The URL with any `user:password@` replaced by `***@` (safe to print)."""
    return re.sub(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@", r"\1***@", url)


def default_name(cfg: RewardSourceConfig) -> str:
    """A metric-friendly name derived from the source's path."""
    path = cfg.path
    if cfg.kind == "function":
        base = path.rsplit(":", 1)[-1]
    elif cfg.kind == "http":
        host = re.sub(r"^[a-z]+://", "", mask_url(path)).split("/")[0].split("@")[-1]
        base = "http_" + host.split(":")[0]
    else:
        base = os.path.basename(os.path.normpath(path.rsplit(":", 1)[-1])) or cfg.kind
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", base).strip("_") or cfg.kind
