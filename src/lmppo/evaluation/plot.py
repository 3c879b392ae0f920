"""Training curves from one or more runs' ``metrics.jsonl``, drawn into one PNG (``lmppo plot``).

Design notes: docs/design.md, `lmppo.evaluation.plot`."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, AbstractSet, NamedTuple

from lmppo.errors import LmppoError
from lmppo.run.layout import CONFIG, METRICS, SUMMARY
from lmppo.run.metrics_file import read_jsonl

if TYPE_CHECKING:
    from matplotlib.artist import Artist

Row = dict[str, object]
"""A row of metrics.jsonl as read (values are checked where they are drawn, `_number`)."""
RunRows = tuple[str, list[Row]]
"""(a run's label, its rows)."""


class HeldoutMeans(NamedTuple):
    """The held-out comparison of a run's summary.json (`lmppo.evaluation.summary.RunSummary`), as read."""

    before: Row  # {} when the initial policy was not sampled
    after: Row


DEFAULT_KEYS = (
    "objective/scores",
    "reward/*",
    "objective/rlhf_reward",
    "objective/kl",
    "objective/kl_coef",
    "objective/non_score_reward",
    "objective/entropy",
    "policy/clipfrac_avg",
    "policy/approxkl_avg",
    "loss/policy_avg",
    "loss/value_avg",
    "val/ratio",
    "response/length_mean",
    "response/truncated_frac",
    "episode/turns",
    "episode/ended_by_environment",
    "episode/tool_calls",
    "episode/tool_errors",
)
"""Metrics plotted, in this order, when present in at least one run. ``reward/*`` stands for every reward source's
``reward/<name>`` (the judge of weight 0 included, so reward hacking shows next to the score); ``episode/*`` only
with an environment."""

X_KEY = "episode"
SMOOTHING = 0.6
"""Weight of the past in the moving average drawn over runs of at least ``SMOOTH_FROM`` points (0: raw only)."""
SMOOTH_FROM = 10
NOT_SMOOTHED = ("objective/kl_coef", "lr")
"""Deterministic quantities (set by a controller or a schedule, not measured on a batch): never smoothed."""
HELDOUT = {"objective/scores": "score", "objective/kl": "kl", "response/length_mean": "length"}
"""Panel -> field of `summary.json`'s `before` / `after` (plus every `reward/<name>`, under its own name)."""
DURING = {"objective/scores": "eval/score", "objective/kl": "eval/kl", "response/length_mean": "eval/length"}
"""Panel -> the `eval/*` metric of `log.eval_every` drawn on it (plus `eval/reward/<name>` on `reward/<name>`)."""


BESIDE = {"objective/kl": "objective/kl_target"}
"""Panel -> a metric drawn on it as a dotted step line (the number the panel's curve is steered to)."""


def beside_series(panel: str, rows: list[Row]) -> tuple[list[float], list[float]]:
    """(x, y) of the `BESIDE` metric of `panel` in `rows` (empty when there is none, or a run did not log it)."""
    key = BESIDE.get(panel)
    points = [(_number(row.get(X_KEY)), _number(row.get(key))) for row in rows] if key else []
    kept = [(x, y) for x, y in points if x is not None and y is not None]
    return [x for x, _ in kept], [y for _, y in kept]


def eval_key(panel: str) -> str | None:
    """The held-out metric logged during training that belongs on `panel`, if any."""
    return DURING.get(panel) or ("eval/" + panel if panel.startswith("reward/") else None)


def read_metrics(run_dir: str) -> tuple[list[dict], int]:
    """The rows of ``<run_dir>/metrics.jsonl`` (or of the file itself if given one) and the number of
    malformed lines skipped. LmppoError if the file is missing or holds no row."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / METRICS
    if not path.is_file():
        raise LmppoError(f"no metrics file at {path}; give a run directory that holds metrics.jsonl")
    rows, bad = read_jsonl(str(path))
    if not rows:
        raise LmppoError(f"the metrics file {path} holds no metrics" + (f" ({bad} malformed lines)" if bad else ""))
    return rows, bad


def _number(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def ema(values: list[float], weight: float) -> list[float]:
    """Exponential moving average, debiased at the start (as TensorBoard's smoothing):
    s_t = weight * s_{t-1} + (1 - weight) * v_t, reported as s_t / (1 - weight^(t+1))."""
    out, s = [], 0.0
    for t, v in enumerate(values):
        s = weight * s + (1 - weight) * v
        out.append(s / (1 - weight ** (t + 1)))
    return out


def _expand(keys: list[str], runs: list[RunRows], last: AbstractSet[str] = frozenset()) -> list[str]:
    """Replace `prefix/*` by the metrics of that prefix logged by any run (sorted, those in `last` after the
    others; counters left out)."""
    out: list[str] = []
    for k in keys:
        if k.endswith("/*"):
            prefix = k[:-1]
            found = sorted(
                {
                    name
                    for _, rows in runs
                    for r in rows
                    for name in r
                    if name.startswith(prefix) and name not in ("reward/num_invalid",)
                },
                key=lambda name: (name in last, name),
            )
            out += [n for n in found if n not in out]
        elif k not in out:
            out.append(k)
    return out


def _zero_weight_sources(run_dir: str) -> list[str]:
    """Names of the reward sources of weight 0 in the run's config.yaml (none if it cannot be read)."""
    path = Path(run_dir)
    path = (path if path.is_dir() else path.parent) / CONFIG
    try:
        import yaml

        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        return [s.get("name") or "" for s in cfg.get("reward", {}).get("sources", []) if s.get("weight", 1) == 0]
    except Exception:  # noqa: BLE001 - a label only: never fail a plot over it
        return []


def _load_runs(run_dirs: list[str]) -> list[RunRows]:
    """(label, rows) per run; labels are folder names, or the paths given when two folders share a name."""
    runs: list[RunRows] = []
    skipped = 0
    for run_dir in run_dirs:
        rows, bad = read_metrics(run_dir)
        skipped += bad
        folder = Path(run_dir).resolve()
        folder = folder if folder.is_dir() else folder.parent
        runs.append((folder.name or str(folder), rows))
    names = [label for label, _ in runs]
    if len(set(names)) < len(names):  # same folder name in different places: label by the path given
        runs = [(str(d), rows) for d, (_, rows) in zip(run_dirs, runs)]
    if skipped:
        warnings.warn(f"plot: skipped {skipped} malformed line(s) in the metrics files", stacklevel=3)
    return runs


def _panels(runs: list[RunRows], run_dirs: list[str], keys: list[str] | None) -> list[tuple[str, str]]:
    judges = {f"reward/{n}" for d in run_dirs for n in _zero_weight_sources(d)}
    wanted = _expand(list(keys) if keys else list(DEFAULT_KEYS), runs, last=judges)
    present = [
        k
        for k in wanted
        if any(_number(r.get(k)) is not None for _, rows in runs for r in rows) and not _repeats_scores(k, runs)
    ]
    if not present:
        raise LmppoError(
            "plot: none of the metrics " + ", ".join(wanted) + " appear in " + ", ".join(str(d) for d in run_dirs)
        )
    return [(k, k + (" (weight 0: judge)" if k in judges else "")) for k in present]


def _repeats_scores(key: str, runs: list[RunRows]) -> bool:
    """A `reward/<name>` whose every value equals `objective/scores` in its row (the only, unweighted source)."""
    if not key.startswith("reward/"):
        return False
    pairs = [(_number(r.get(key)), _number(r.get("objective/scores"))) for _, rows in runs for r in rows if key in r]
    return bool(pairs) and all(
        a is not None and b is not None and abs(a - b) <= 1e-9 * max(1.0, abs(b)) for a, b in pairs
    )


def read_summary(run_dir: str) -> HeldoutMeans | None:
    """The held-out means of the run's ``summary.json`` (the end-of-run summary), or None when it is absent,
    unreadable or has no comparison."""
    path = Path(run_dir)
    path = (path if path.is_dir() else path.parent) / SUMMARY
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and isinstance(data.get("after"), dict)):
        return None
    before = data.get("before")
    return HeldoutMeans(before if isinstance(before, dict) else {}, data["after"])


def panels(run_dirs: list[str], keys: list[str] | None = None) -> list[tuple[str, str]]:
    """(metric, subplot title) of every subplot ``plot_runs`` draws for these runs, in order."""
    return _panels(_load_runs(run_dirs), run_dirs, keys)


def plot_runs(run_dirs: list[str], out_png: str, keys: list[str] | None = None) -> str:
    """Draw the curves of ``keys`` (default ``DEFAULT_KEYS``; those present) for every run into ``out_png``.

    Returns the PNG's path (written to a temporary name, then renamed). A row without a numeric ``episode``
    is placed at its row index. Non-finite values (NaN, inf) are left out of the curves.
    """
    if not run_dirs:
        raise LmppoError("plot: give at least one run directory")
    try:
        import matplotlib
    except ImportError:
        raise LmppoError("plotting needs matplotlib; install it with: pip install matplotlib") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    runs = _load_runs(run_dirs)
    present = _panels(runs, run_dirs, keys)
    summaries = [read_summary(d) for d in run_dirs]
    ncols = min(3, len(present))
    nrows = math.ceil(len(present) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.0 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    legend: dict[str, Artist] = {}
    for ax, (key, title) in zip(axes.flat, present):
        for r, (label, rows) in enumerate(runs):
            xs, ys = [], []
            for i, row in enumerate(rows):
                y = _number(row.get(key))
                if y is None:
                    continue
                x = _number(row.get(X_KEY))
                xs.append(x if x is not None else float(i))
                ys.append(y)
            if xs:
                color = colors[r % len(colors)]
                if SMOOTHING and len(xs) >= SMOOTH_FROM and key not in NOT_SMOOTHED:
                    ax.plot(xs, ys, linewidth=0.8, color=color, alpha=0.3)
                    (line,) = ax.plot(xs, ema(ys, SMOOTHING), label=label, linewidth=1.6, color=color)
                else:
                    (line,) = ax.plot(
                        xs, ys, label=label, linewidth=1.3, color=color, marker="." if len(xs) < 30 else None
                    )
                legend.setdefault(label, line)
                bx, by = beside_series(key, rows)
                if bx:
                    (target,) = ax.plot(bx, by, linestyle=":", drawstyle="steps-post", linewidth=1.2, color=color)
                    legend.setdefault(BESIDE[key].removeprefix("objective/").replace("_", "."), target)
                during = [(_number(row.get(X_KEY)), _number(row.get(eval_key(key) or ""))) for row in rows]
                during = [(x, y) for x, y in during if x is not None and y is not None]
                if during:
                    (dots,) = ax.plot(
                        [x for x, _ in during],
                        [y for _, y in during],
                        linestyle="--",
                        marker="o",
                        markersize=3,
                        linewidth=1.0,
                        color=color,
                    )
                    legend.setdefault("held-out during training (eval/*)", dots)
                field = HELDOUT.get(key, key if key.startswith("reward/") else None)
                summary = summaries[r]
                if field and summary is not None:
                    before, after = summary.before.get(field), summary.after.get(field)
                    if _number(after) is not None:
                        hx = [0.0, xs[-1]] if _number(before) is not None else [xs[-1]]
                        hy = [before, after] if _number(before) is not None else [after]
                        (held,) = ax.plot(hx, hy, linestyle="none", marker="x", markersize=8, mew=1.8, color=color)
                        legend.setdefault("held-out before / after (summary.json)", held)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(X_KEY, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present) :]:
        ax.axis("off")
    if legend:
        fig.legend(
            list(legend.values()), list(legend), loc="upper center", ncol=min(len(legend), 4), fontsize=9, frameon=False
        )
    fig.tight_layout(rect=(0, 0, 1, 0.94 if nrows > 1 else 0.88))
    out = Path(out_png)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}.png")
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        if tmp.exists():
            tmp.unlink()
    return str(out)
