"""Reading a run's `metrics.jsonl` back: the whole run's rows (a resumed run's summary starts at iteration 1, not
at the resume), and what a file cut or edited by hand has lost (said once, on resume, instead of nothing)."""

from __future__ import annotations

import json
import os
import warnings
from typing import Mapping, Optional

from lmppo.run.layout import METRICS


def controller_beta(m: Mapping[str, Optional[float]]) -> float:
    """The KL controller's beta in an iteration's metrics, wherever the KL acts: `loss/kl_coef` when the KL is a
    loss term (`kl.placement: loss` or `both`, or `kl.estimator: exact`), else `objective/kl_coef`. The latter is
    the beta of the rewards' penalty, 0 when the KL is in the loss only: read alone it showed "beta 0.0000" for
    the whole of a run whose controller moved its beta between 0.008 and 0.14."""
    beta = m.get("loss/kl_coef")
    if beta is None:
        beta = m.get("objective/kl_coef")
    return float(beta or 0.0)


def read_jsonl(path: str) -> tuple[list[dict], int]:
    """(the JSON objects of the lines of `path`, in file order; the number of lines that are not JSON objects:
    torn, cut or edited). Blank lines are skipped; OSError when the file cannot be read."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        lines = fh.read().split("\n")
    rows, bad = [], 0
    for line in lines:
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
    return rows, bad


def read_rows(output_dir: str) -> tuple[list[dict], int]:
    """(the rows of `OUTPUT_DIR/metrics.jsonl` that have an integer `iteration`, in file order; the number of
    lines that are not JSON objects: torn, cut or edited). ([], 0) when there is no file."""
    try:
        objects, bad = read_jsonl(os.path.join(output_dir, METRICS))
    except OSError:
        return [], 0
    rows = []
    for row in objects:
        it = row.get("iteration")
        if isinstance(it, (int, float)) and not isinstance(it, bool) and float(it).is_integer():
            rows.append({**row, "iteration": int(it)})
    return rows, bad


def run_rows(output_dir: str, upto: int) -> list[dict]:
    """One row per iteration 1..`upto` that metrics.jsonl holds (the last one written for an iteration wins)."""
    rows, _bad = read_rows(output_dir)
    by_iteration = {r["iteration"]: r for r in rows if 1 <= r["iteration"] <= upto}
    return [by_iteration[i] for i in sorted(by_iteration)]


def _spans(numbers: list[int]) -> str:
    spans: list[str] = []
    for n in numbers:
        if spans and int(spans[-1].split("-")[-1]) == n - 1:
            spans[-1] = f"{spans[-1].split('-')[0]}-{n}"
        else:
            spans.append(str(n))
    return ", ".join(spans)


def lost_rows(output_dir: str, iteration: int) -> str:
    """What metrics.jsonl of a run checkpointed at `iteration` lacks: '' when it holds a row for each of
    iterations 1..`iteration`, else one sentence naming the missing iterations."""
    if not os.path.isfile(os.path.join(output_dir, METRICS)):
        return f"{METRICS} is missing: the rows of iterations 1-{iteration} are lost" if iteration else ""
    rows, bad = read_rows(output_dir)
    have = {r["iteration"] for r in rows}
    missing = [i for i in range(1, iteration + 1) if i not in have]
    if not missing:
        return ""
    torn = f" ({bad} unreadable line{'s' * (bad != 1)}: cut or edited by hand?)" if bad else " (removed by hand?)"
    return (
        f"{METRICS} lacks the rows of iteration{'s' * (len(missing) != 1)} {_spans(missing)} of the "
        f"{iteration} the checkpoint holds{torn}; training resumes exactly, but the summary, plots and trackers "
        "have no values for them"
    )


def warn_lost(output_dir: str, iteration: int) -> None:
    """One warning when metrics.jsonl lacks rows up to the checkpoint's `iteration` (`lost_rows`)."""
    lost = lost_rows(output_dir, iteration)
    if lost:
        warnings.warn(lost, stacklevel=3)
