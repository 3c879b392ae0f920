"""What an evaluation prints: the before/after metric and win-rate rows shared by `lmppo eval`, the end-of-run
summary and model cards, the judge that is named by default, and the table of sampled responses."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Collection, Mapping, Optional, Sequence, TypedDict

from rich.console import Console
from rich.table import Table
from rich.text import Text

from lmppo.errors import LmppoError

if TYPE_CHECKING:
    from lmppo.rewards import RewardSource

Means = dict[str, Optional[float]]
"""A policy's means over its responses (`lmppo.evaluation.heldout.PolicyEval.means`): None where not measured."""


class EvalSample(TypedDict):
    """One response of each model to a prompt in `lmppo eval`'s result."""

    prompt: str
    start: str
    trained: str
    start_scores: dict[str, float]
    trained_scores: dict[str, float]
    trained_kl: float  # this response's log pi - log pi_start, summed (k1)


class EvalResult(TypedDict):
    """`lmppo eval`'s result (`eval.json`, `lmppo.evaluation.evaluate.evaluate_models`)."""

    model: str
    start: str
    run_dir: Optional[str]
    prompts: int
    samples_per_prompt: int
    held_out: bool
    temperature: float
    max_new_tokens: int
    seed: int
    precision: str
    backend: str
    judge: str
    weights: dict[str, float]
    watch: dict[str, str]
    trained: Means
    start_point: Means
    win_rate: float
    win_rate_by_source: dict[str, float]
    samples: list[EvalSample]


@dataclass(frozen=True)
class ComparedPrompt:
    """A row of `sample_comparison`: a prompt and a response of each model, each with its scores."""

    prompt: str
    before: str
    after: str
    before_scores: Mapping[str, float] = field(default_factory=dict)
    after_scores: Mapping[str, float] = field(default_factory=dict)


PIPED_WIDTH = 200
"""Columns of output that goes to a file or a pipe (no terminal to fit): wide enough that a table row or a line
is not cut at rich's default of 80 (`$COLUMNS` still wins)."""


def make_console() -> Console:
    """The console lmppo prints on: a terminal's own width; piped or redirected, `PIPED_WIDTH` columns."""
    console = Console(highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(highlight=False, width=PIPED_WIDTH)
    return console


def default_judge(weights: dict[str, float], watch: Collection[str] = ()) -> str:
    """The first source of weight 0 (a judge logged but never trained on) that is not a `watch` metric (a warning
    sign, where higher is worse), else the first source."""
    if not weights:
        raise LmppoError("no reward sources to judge with")
    return next((n for n, w in weights.items() if w == 0 and n not in watch), next(iter(weights)))


def watched(sources: Sequence[RewardSource]) -> dict[str, str]:
    """Name -> note of the sources that are warning signs (`RewardSource.watch`)."""
    return {s.name: s.watch for s in sources if s.watch}


def metric_rows(
    before: Means,
    after: Means,
    weights: dict[str, float],
    watch: Optional[dict[str, str]] = None,
) -> list[tuple[str, str, str, str]]:
    """(label, before, after, change) rows shared by `lmppo eval` and the end-of-run summary; a `watch` source (a
    warning sign: higher is worse) is labelled so."""
    rows: list[tuple[str, Optional[float], Optional[float], str]] = [
        ("score (training reward)", before.get("score"), after.get("score"), "+")
    ]
    for name, w in weights.items():
        tags = ["weight 0"] if w == 0 else ([f"weight {w:g}"] if w != 1 else [])
        tags += ["watch: higher is worse"] if name in (watch or {}) else []
        tag = f" ({', '.join(tags)})" if tags else ""
        rows.append((f"reward/{name}{tag}", before.get(f"reward/{name}"), after.get(f"reward/{name}"), "+"))
    rows.append(("KL to reference, k1 (nats)", before.get("kl"), after.get("kl"), ""))
    rows.append(("KL to reference, k3 (nats)", before.get("kl_k3"), after.get("kl_k3"), ""))
    rows.append(("KL to reference, exact (nats)", before.get("kl_exact"), after.get("kl_exact"), ""))
    rows.append(("length (tokens)", before.get("length"), after.get("length"), ""))
    rows.append(("ended with stop token", before.get("terminated_frac"), after.get("terminated_frac"), ""))

    def fmt(v: Optional[float], sign: str) -> str:
        return "n/a" if v is None else (f"{v:+.3f}" if sign else f"{v:.3f}")

    out = []
    for label, b, a, sign in rows:
        change = "" if a is None or b is None else f"{a - b:+.3f}"
        out.append((label, fmt(b, sign), fmt(a, sign), change))
    return out


def win_rows(
    wins: dict[str, float], judge: str, watch: Optional[dict[str, str]] = None
) -> list[tuple[str, str, str, str]]:
    """The win-rate rows of a before/after table: the judge's first, then the other sources; a `watch` source's
    share of prompts where the trained model scores higher is a warning, not a win, and is labelled so."""
    watch = watch or {}
    rows = [(f"win rate by {judge} (judge)", "", f"{wins[judge]:.3f}", "")]
    for name, w in wins.items():
        if name == judge:
            continue
        label = f"{name} higher than at the start (watch: {watch[name]})" if name in watch else f"win rate by {name}"
        rows.append((label, "", f"{w:.3f}", ""))
    return rows


def print_eval(result: EvalResult, console: Console, show: int = 3) -> None:
    where = "held-out" if result["held_out"] else "training (no held-out split)"
    k = result.get("samples_per_prompt", 1)
    table = Table(
        title=f"{result['model']} vs {result['start']}: {result['prompts']} {where} prompts x {k} "
        f"samples, T={result['temperature']:g}, seed {result['seed']}",
        title_justify="left",
    )
    add_metric_columns(table, "start", "trained")
    watch = result["watch"]
    for row in metric_rows(result["start_point"], result["trained"], result["weights"], watch):
        table.add_row(*row)
    for row in win_rows(result["win_rate_by_source"], result["judge"], watch):
        table.add_row(*row)
    console.print(table)
    if show > 0 and result["samples"]:
        firsts = [  # the first response to each of the first prompts
            ComparedPrompt(s["prompt"], s["start"], s["trained"], s["start_scores"], s["trained_scores"])
            for s in result["samples"][::k][:show]
        ]
        console.print(
            sample_comparison(
                firsts, "start", "trained", "the first held-out prompts: a response of each model, with its scores"
            )
        )


def add_metric_columns(table: Table, before: str, after: str) -> None:
    """The columns of a before/after metric table: metric | `before` | `after` | change."""
    table.add_column("metric", justify="left")
    for name in (before, after, "change"):
        table.add_column(name, justify="right")


def sample_comparison(rows: Sequence[ComparedPrompt], before_name: str, after_name: str, title: str = "") -> Table:
    """A rich table: prompt | response before | response after, each response followed by its scores."""
    table = Table(show_lines=True, title=title or None, title_justify="left", expand=True)
    table.add_column("prompt", overflow="fold", ratio=2)
    table.add_column(before_name, overflow="fold", ratio=3)
    table.add_column(after_name, overflow="fold", ratio=3)
    for row in rows:
        cells = []
        for response, scores in ((row.before, row.before_scores), (row.after, row.after_scores)):
            text = Text(response.strip() or "(empty)")
            if scores:
                text.append("\n" + "  ".join(f"{n} {v:+.2f}" for n, v in scores.items()), style="dim")
            cells.append(text)
        table.add_row(Text(row.prompt), *cells)
    return table
