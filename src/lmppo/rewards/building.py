"""Building a run's reward sources: the config's `reward.sources` (each kind through the registry) plus the
callables given through the Python API, with unique names; and the context they are built in."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from lmppo.config import Config, RewardConfig
from lmppo.models.loading import resolve_model_path
from lmppo.registry import REWARD_SOURCES
from lmppo.rewards.functions import FunctionSource
from lmppo.rewards.sources import RewardSource, SourceContext


def build_reward_sources(
    reward_cfg: RewardConfig,
    functions: dict[str, Callable] | Sequence[Callable] | None = None,
    device: str = "cpu",
    ctx: SourceContext | None = None,
) -> list[RewardSource]:
    """The sources of ``reward_cfg.sources`` plus the callables given through the API.

    ``functions``: a list of callables, or a name -> callable dict. A dict key equal to the ``path`` of a
    ``function`` source in the config binds that callable to that source (so its weight, name and span placement
    come from the config); every other callable becomes an extra source with weight 1 and ``last`` placement,
    named by its key (dict) or its ``__name__`` (list). A RewardSource instance is used as it is.
    Names must be unique (they become the `reward/<name>` metrics): repeated ones get `_2`, `_3`, ...
    """
    ctx = ctx or SourceContext(device=device)
    given: dict[str, Callable] = dict(functions) if isinstance(functions, dict) else {}
    extra: list[tuple[str, Callable]] = []
    if isinstance(functions, dict):
        bound = {s.path for s in reward_cfg.sources if s.kind == "function"}
        extra = [(k, f) for k, f in given.items() if k not in bound]
    elif functions is not None:
        if callable(functions):
            functions = [functions]
        extra = [("", f) for f in functions]
    sources: list[RewardSource] = []
    for i, scfg in enumerate(reward_cfg.sources):
        REWARD_SOURCES.check(scfg.kind, f"reward.sources[{i}].kind")  # one error line naming the allowed kinds
        if scfg.kind == "function" and scfg.path in given:
            sources.append(FunctionSource(scfg, ctx, fn=given[scfg.path]))
        else:
            sources.append(REWARD_SOURCES[scfg.kind](scfg, ctx))
    for name, fn in extra:
        sources.append(fn if isinstance(fn, RewardSource) else FunctionSource.from_callable(fn, name=name))
    seen: dict[str, int] = {}
    for s in sources:
        base = s.name
        seen[base] = seen.get(base, 0) + 1
        if seen[base] > 1:
            s.name = f"{base}_{seen[base]}"
    return sources


def run_source_context(cfg: Config, device: torch.device, precision: str) -> SourceContext:
    """The context a run's sources are built in, by training and `lmppo eval` alike: its device, model-file
    permissions and no-grad batch size, reward models under the run's bf16 autocast when `precision` is bf16."""
    return SourceContext(
        device=str(device),
        allow_pickle=cfg.model.allow_pickle,
        trust_remote_code=cfg.model.trust_remote_code,
        strict=cfg.model.strict,
        batch_size=cfg.no_grad_batch_size,
        resolve_path=lambda p: resolve_model_path(p, "reward model", cfg.model.allow_pickle),
        autocast_dtype=torch.bfloat16 if precision == "bf16" else None,
    )
