"""Training curves from one or more runs' ``metrics.jsonl``, drawn into one PNG (``lmppo plot``).

Each run directory holds ``metrics.jsonl``: one JSON object per PPO iteration. One subplot per metric (those
of ``DEFAULT_KEYS`` that at least one run logged, in that order), x = ``episode``, runs overlaid and named by
their directory. Lines that are not valid JSON objects (a run killed mid-write) are skipped and counted.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

from lmppo.errors import LmppoError

DEFAULT_KEYS = (
    "objective/scores",
    "objective/rlhf_reward",
    "objective/kl",
    "objective/non_score_reward",
    "objective/entropy",
    "policy/clipfrac_avg",
    "policy/approxkl_avg",
    "loss/policy_avg",
    "loss/value_avg",
    "val/ratio",
    "response/length_mean",
    "response/truncated_frac",
)
"""Metrics plotted, in this order, when present in at least one run."""

X_KEY = "episode"


def read_metrics(run_dir: str) -> tuple[list[dict], int]:
    """The rows of ``<run_dir>/metrics.jsonl`` (or of the file itself if given one) and the number of
    malformed lines skipped. LmppoError if the file is missing or holds no row."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise LmppoError(f"no metrics file at {path}; give a run directory that holds metrics.jsonl")
    rows, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad += 1
    if not rows:
        raise LmppoError(f"the metrics file {path} holds no metrics" + (f" ({bad} malformed lines)" if bad else ""))
    return rows, bad


def _number(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


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

    runs = []
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
        warnings.warn(f"plot: skipped {skipped} malformed line(s) in the metrics files", stacklevel=2)

    wanted = list(keys) if keys else list(DEFAULT_KEYS)
    present = [k for k in wanted if any(_number(r.get(k)) is not None for _, rows in runs for r in rows)]
    if not present:
        raise LmppoError("plot: none of the metrics " + ", ".join(wanted) + " appear in "
                         + ", ".join(str(d) for d in run_dirs))

    ncols = min(3, len(present))
    nrows = math.ceil(len(present) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.0 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    legend: dict[str, object] = {}
    for ax, key in zip(axes.flat, present):
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
                (line,) = ax.plot(xs, ys, label=label, linewidth=1.3, color=colors[r % len(colors)],
                                  marker="." if len(xs) < 30 else None)
                legend.setdefault(label, line)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel(X_KEY, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    if legend:
        fig.legend(list(legend.values()), list(legend), loc="upper center", ncol=min(len(legend), 4), fontsize=9,
                   frameon=False)
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
