"""Metrics: an accumulator, trackers in a registry, and the table of sample completions.

`OUTPUT_DIR/metrics.jsonl` (one JSON object per iteration) is always written and flushed each iteration, so
a run killed at any point keeps every metric it logged. Trackers (tensorboard, wandb, trackio, and through
accelerate's tracker API aim, comet_ml, mlflow, clearml, dvclive, swanlab) are optional.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Optional, TypeVar

import torch

import lmppo.run.layout as layout
import lmppo.run.signals as signals
import lmppo.run.storage as storage
from lmppo.core.masking import masked_sum
from lmppo.errors import LmppoError
from lmppo.registry import TRACKERS
from lmppo.run.config_file import redacted_config_dict

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from lmppo.config import Config


class PhaseTimer:
    """Wall-clock seconds of each phase of an iteration (`time/<phase>`): `with timer("rollout"): ...` adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


class MetricsAccumulator:
    """Collects scalar tensors under names during an iteration; `summary()` turns them into floats once.

    Values stay tensors until the end of the iteration (no `.item()` sync inside the update loop).
    """

    def __init__(self) -> None:
        self._values: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._kept: dict[str, list[torch.Tensor]] = defaultdict(list)  # names added with `add_where`

    def add(self, name: str, value: torch.Tensor | float) -> None:
        self._values[name].append(torch.as_tensor(value, dtype=torch.float32).detach().reshape(()))

    def add_where(self, name: str, value: torch.Tensor, keep: torch.Tensor) -> None:
        """`value` counts under `name` only where the 0-dim bool `keep` is True, decided on the device (no read):
        `mean` and `in` see the kept values only."""
        self.add(name, value)
        self._kept[name].append(keep.detach().reshape(()))

    def _kept_values(self, name: str) -> torch.Tensor:
        values = torch.stack(self._values[name])
        if name not in self._kept:
            return values
        keep = torch.stack(self._kept[name])
        return values if bool(keep.all()) else values[keep]

    def mean(self, name: str) -> float:
        return self._kept_values(name).mean().item()

    def recent_mean(self, name: str, n: int) -> float:
        """Mean of the last `n` values added under `name`."""
        return torch.stack(self._values[name][-n:]).mean().item()

    def var(self, name: str) -> float:
        """Unbiased variance (n - 1 in the denominator), as TRL's `val/ratio_var` (`torch.var`); 0 for one value."""
        vals = torch.stack(self._values[name])
        return vals.var(unbiased=True).item() if vals.numel() > 1 else 0.0

    def count(self, name: str) -> int:
        """How many values were added under `name`."""
        return len(self._values.get(name, []))

    def max(self, name: str) -> float:
        return max(v.item() for v in self._values[name])

    def __contains__(self, name: str) -> bool:
        if name in self._kept:
            return bool(torch.stack(self._kept[name]).any())
        return name in self._values

    def means(self) -> dict[str, float]:
        return {k: self._kept_values(k).mean().item() for k in self._values}


# ----------------------------------------------------------------------------- trackers
TrackerClass = TypeVar("TrackerClass", bound="type[Tracker]")


def register_tracker(name: str) -> Callable[[TrackerClass], TrackerClass]:
    """Add a tracker class to `lmppo.registry.TRACKERS` (a name taken twice is refused)."""
    return TRACKERS.register(name)


class Tracker:
    package = ""
    """The Python package the tracker needs (checked before any model loads: `missing_package`)."""

    @classmethod
    def missing_package(cls) -> str:
        """The name of the package this tracker needs and this environment lacks, or ""."""
        return cls.package if cls.package and importlib.util.find_spec(cls.package) is None else ""

    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def log_table(self, rows: list[dict[str, object]], step: int) -> None: ...
    def close(self) -> None: ...


@register_tracker("tensorboard")
class TensorBoardTracker(Tracker):
    package = "tensorboard"

    def __init__(self, output_dir: str, config: dict, run_name: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(output_dir, layout.TENSORBOARD))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def log(self, metrics, step):
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_table(self, rows, step):
        if rows:
            head = "| " + " | ".join(rows[0]) + " |\n|" + "---|" * len(rows[0]) + "\n"
            body = "".join(
                "| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in r.values()) + " |\n"
                for r in rows
            )
            self.writer.add_text("samples", head + body, step)

    def close(self):
        self.writer.close()


@register_tracker("wandb")
class WandbTracker(Tracker):
    """Weights & Biases. The run lives in `OUTPUT_DIR/wandb`; set WANDB_MODE=offline to run without a network
    (sync later with `wandb sync OUTPUT_DIR/wandb/offline-run-*`), WANDB_PROJECT to choose the project
    (default `lmppo`). The run is named after the output folder."""

    package = "wandb"

    def __init__(self, output_dir: str, config: dict, run_name: str):
        import wandb

        self.wandb = wandb
        # console="off": wandb would otherwise wrap stdout/stderr, which garbles the live progress bar
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "lmppo"),
            name=run_name,
            config=config,
            dir=output_dir,
            settings=wandb.Settings(console="off"),
        )

    def log(self, metrics, step):
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def log_table(self, rows, step):
        if rows:
            table = self.wandb.Table(columns=list(rows[0]), data=[[_cell(v) for v in r.values()] for r in rows])
            self.run.log({"samples": table}, step=step)

    def close(self):
        self.run.finish()


@register_tracker("trackio")
class TrackioTracker(Tracker):
    """trackio (a local, wandb-like dashboard: `trackio show`). Its database is trackio's own (TRACKIO_DIR,
    default under the Hugging Face cache), not the output folder; TRACKIO_PROJECT chooses the project
    (default `lmppo`). The run is named after the output folder."""

    package = "trackio"

    def __init__(self, output_dir: str, config: dict, run_name: str):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "lmppo"), name=run_name, config=config)

    def log(self, metrics, step):
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def log_table(self, rows, step):
        if rows:
            table = self.trackio.Table(columns=list(rows[0]), data=[[_cell(v) for v in r.values()] for r in rows])
            self.run.log({"samples": table}, step=step)

    def close(self):
        self.run.finish()


def _cell(v: object) -> object:
    return v if isinstance(v, (int, float, str)) else str(v)


ACCELERATE_TRACKERS = ("aim", "comet_ml", "mlflow", "clearml", "dvclive", "swanlab")
"""Trackers driven through accelerate's tracker API (`accelerate.tracking.LOGGER_TYPE_TO_CLASS`). tensorboard, wandb
and trackio, which accelerate also supports, keep the classes above: they send the sample tables as native
tables, which accelerate's `log` cannot."""


class AccelerateTracker(Tracker):
    """One of accelerate's trackers, as `Accelerator.init_trackers` starts it: constructed with the run name as its
    project (and `OUTPUT_DIR/<name>` as its folder when it needs one), `start()`, the config (flattened to dotted
    keys) given to `store_init_configuration`; metrics through `log(values, step=episode)`, `finish()` at the end.
    Sample tables are not sent (they are in `samples.jsonl`). Each tracker reads its own settings from its usual
    environment variables (MLFLOW_TRACKING_URI, COMET_API_KEY, ...)."""

    name = ""

    @classmethod
    def missing_package(cls) -> str:
        from accelerate import tracking

        return "" if getattr(tracking, f"is_{cls.name}_available", lambda: True)() else cls.name

    def __init__(self, output_dir: str, config: dict, run_name: str):
        from accelerate import tracking

        if not getattr(tracking, f"is_{self.name}_available", lambda: True)():
            raise ImportError(f"{self.name} is not installed", name=self.name)
        cls = tracking.LOGGER_TYPE_TO_CLASS[self.name]
        if getattr(cls, "requires_logging_directory", False):
            self.tracker = cls(run_name, os.path.join(output_dir, self.name))
        else:
            self.tracker = cls(run_name)
        self.tracker.start()
        self.tracker.store_init_configuration(_flatten(config))

    def log(self, metrics, step):
        self.tracker.log(
            {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}, step=step
        )

    def close(self):
        self.tracker.finish()


def _flatten(config: dict[str, object], prefix: str = "") -> dict[str, object]:
    """{"ppo": {"lr": 1}} -> {"ppo.lr": 1}; lists and other values as strings unless plain numbers/strings."""
    out: dict[str, object] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (bool, int, float, str)) or v is None else str(v)
    return out


@register_tracker("aim")
class AimTracker(AccelerateTracker):
    name = "aim"


@register_tracker("comet_ml")
class CometMLTracker(AccelerateTracker):
    name = "comet_ml"


@register_tracker("mlflow")
class MLflowTracker(AccelerateTracker):
    name = "mlflow"


@register_tracker("clearml")
class ClearMLTracker(AccelerateTracker):
    name = "clearml"


@register_tracker("dvclive")
class DVCLiveTracker(AccelerateTracker):
    name = "dvclive"


@register_tracker("swanlab")
class SwanLabTracker(AccelerateTracker):
    name = "swanlab"


def make_trackers(names: list[str], output_dir: str, config: dict, run_name: str) -> list[Tracker]:
    """The trackers named in `log.trackers`; LmppoError (one line) when a package is missing or a tracker cannot
    start, after closing those already started."""
    out: list[Tracker] = []
    for name in names:
        try:
            out.append(TRACKERS[name](output_dir, config, run_name))
        except ImportError as err:
            _close_all(out)
            raise LmppoError(
                f"log.trackers includes `{name}` but its package is missing ({err.name}); "
                f"install it (`pip install {name}`) or remove it from log.trackers"
            ) from None
        except Exception as err:  # noqa: BLE001 - e.g. wandb without an API key: a user mistake, one line
            _close_all(out)
            hint = " (set WANDB_MODE=offline to log without an account)" if name == "wandb" else ""
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise LmppoError(f"log.trackers: `{name}` could not start: {type(err).__name__}: {first}{hint}") from err
    return out


def _close_all(trackers: list[Tracker]) -> None:
    for t in trackers:
        try:
            t.close()
        except Exception:  # noqa: BLE001 - already failing; do not hide the first error
            pass


class MetricsLogger:
    """metrics.jsonl + trackers + the sample table on the console."""

    def __init__(self, output_dir: str, trackers: list[Tracker], console=None, append: bool = False):
        self.path = os.path.join(output_dir, layout.METRICS)
        self.samples_path = os.path.join(output_dir, layout.SAMPLES)
        if not append:  # a new run starts an empty file (lmppo.run.storage: written atomically, failures named)
            storage.write_text(self.path, "", "the metrics log (metrics.jsonl)")
        self.trackers = trackers
        self.console = console
        self.output_dir = output_dir

    def _keep(self) -> str:
        """What a failed write leaves intact, and the command that goes on from there (`signals.go_on`)."""
        return f"the lines before are intact; free space (or fix the folder), then {signals.go_on(self.output_dir)}"

    def log(self, metrics: dict[str, float], step: int) -> None:
        line = json.dumps({k: _jsonable(v) for k, v in metrics.items()})
        storage.append_lines(
            self.path, [line], f"the metrics of iteration {metrics.get('iteration', '?')} (metrics.jsonl)", self._keep()
        )  # whole or not at all
        for t in self.trackers:
            t.log(metrics, step)

    def log_samples(self, rows: list[dict[str, object]], step: int, title: str) -> None:
        storage.append_lines(
            self.samples_path,
            [json.dumps({"episode": step, **r}, default=str) for r in rows],
            f"the sample table of episode {step} (samples.jsonl)",
            self._keep(),
        )
        for t in self.trackers:
            t.log_table(rows, step)
        if self.console is not None and rows:
            self.console.print(sample_table(rows, title))

    def close(self) -> None:
        for t in self.trackers:
            t.close()


def _jsonable(v: object) -> object:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def sample_table(rows: list[dict[str, object]], title: str) -> Table:
    from rich.table import Table

    table = Table(title=title, show_lines=True)
    for col in rows[0]:
        table.add_column(col, overflow="fold", max_width=60 if col in ("prompt", "response") else 30)
    for r in rows:
        table.add_row(*[f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()])
    return table


# ----------------------------------------------------------------------------- the negative-KL guard


def warn_negative_kl(
    mean_kl: float, threshold: float, kl: torch.Tensor, mask: torch.Tensor, responses_text: list[str]
) -> None:
    """A warning naming the lowest-KL samples when the mean KL per response is below `kl.warn_below`.
    kl, mask: (B, T) per-token KL estimates and the response mask."""
    if mean_kl >= threshold:
        return
    per_response = masked_sum(kl, mask, dim=1)
    worst = torch.argsort(per_response)[:3].tolist()
    token_min = kl[mask].min().item()
    examples = "; ".join(f"#{i}: {responses_text[i][:60]!r} (kl {per_response[i].item():.2f})" for i in worst)
    warnings.warn(
        f"mean KL per response is {mean_kl:.3f} (< kl.warn_below {threshold}); lowest per-token KL "
        f"{token_min:.3f}. Negative KL means tokens are sampled from a distribution other than the one "
        f"measured: usually generation settings (top_k, top_p, min_new_tokens, repetition penalties) or a "
        f"temperature mismatch. Lowest samples: {examples}",
        stacklevel=2,
    )


def open_logger(cfg: Config, console: Optional[Console], append: bool) -> "MetricsLogger":
    """The run's metrics logger: metrics.jsonl and samples.jsonl in `cfg.output_dir` and the trackers of
    `log.trackers`, told the config (secrets masked); `append`: a resumed run continues the files."""
    name = os.path.basename(os.path.abspath(cfg.output_dir))
    trackers = make_trackers(cfg.log.trackers, cfg.output_dir, redacted_config_dict(cfg), name)
    return MetricsLogger(cfg.output_dir, trackers, console, append=append)
