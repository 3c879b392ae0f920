"""What this machine must have for a run, checked before the run folder is made or any model loads: one ConfigError
naming the field, the value and what works here."""

from __future__ import annotations

from typing import Sequence

import torch

from lmppo.config import Config
from lmppo.environments.factories import Tool
from lmppo.environments.tools import checked_tool_schemas
from lmppo.errors import ConfigError
from lmppo.models.loading import check_memory_options
from lmppo.registry import TRACKERS
from lmppo.sampling.engines import check_sampling_engine

CPU_ATTENTION = ("auto", "sdpa", "eager")
"""`model.attn_implementation` values that run on a CPU (flash attention is CUDA only; torch's flex attention on a
CPU compiles C++ through inductor, which fails after a minute with pages of compiler output)."""


def check_machine(cfg: Config) -> None:
    """The device, the sampling engine, the attention kernel, the trackers' packages (the environment and its tools
    are loaded right after, `lmppo.environments.factories.load_run_environment`: a missing file or class is one
    error line before any model loads)."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device",
            cfg.device,
            "this machine has no CUDA GPU that torch can use "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); use device `cpu` or `auto`",
        )
    check_sampling_engine(cfg)  # e.g. `vllm`: a GPU and the package
    device_type = "cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu"
    if cfg.model.attn_implementation == "flex_attention" and device_type == "cpu":
        raise ConfigError(
            "model.attn_implementation",
            "flex_attention",
            "does not run on a CPU (torch compiles it with inductor, which fails there); on CPU use "
            + ", ".join(f"`{a}`" for a in CPU_ATTENTION),
        )
    check_memory_options(cfg.model, device_type)  # 4-bit loading, flash attention
    check_tracker_packages(cfg.log.trackers)


def check_tracker_packages(names: list[str]) -> None:
    """Each tracker's package is installed (`Tracker.missing_package`; a class without it is not checked)."""
    for name in names:
        missing = getattr(TRACKERS.get(name), "missing_package", lambda: "")()
        if missing:
            raise ConfigError(
                "log.trackers",
                name,
                f"needs the `{missing}` package, which is not installed: pip install {missing} (or remove it from "
                "log.trackers; metrics.jsonl is always written)",
            )


def check_tools(tools: Sequence[Tool]) -> None:
    """Each tool of the run (`environment.tools`, `tools=` objects) can be described to the model (type hints, a
    docstring): transformers' schema error otherwise comes as a traceback after the models loaded."""
    for tool in tools:
        try:
            checked_tool_schemas([tool])
        except ValueError as err:
            raise ConfigError("environment.tools", getattr(tool, "__name__", tool), str(err)) from None
