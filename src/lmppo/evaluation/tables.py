"""What an evaluation prints: the before/after metric and win-rate rows shared by `lmppo eval`, the end-of-run
summary and model cards, the judge that is named by default, and the table of sampled responses."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from lmppo.errors import LmppoError

PIPED_WIDTH = 200
"""Columns of output that goes to a file or a pipe (no terminal to fit): wide enough that a table row or a line
is not cut at rich's default of 80 (`$COLUMNS` still wins)."""


def make_console() -> Console:
    """The console lmppo prints on: a terminal's own width; piped or redirected, `PIPED_WIDTH` columns."""
    console = Console(highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(highlight=False, width=PIPED_WIDTH)
    return console


def default_judge(weights: dict[str, float], watch: Sequence[str] = ()) -> str:
    """The first source of weight 0 (a judge logged but never trained on) that is not a `watch` metric (a warning
    sign, where higher is worse), else the first source."""
    if not weights:
        raise LmppoError("no reward sources to judge with")
    return next((n for n, w in weights.items() if w == 0 and n not in watch), next(iter(weights)))


def watched(sources: Sequence[Any]) -> dict[str, str]:
    """Name -> note of the sources that are warning signs (`RewardSource.watch`)."""
    return {s.name: s.watch for s in sources if getattr(s, "watch", "")}


def metric_rows(
    before: dict[str, Optional[float]],
    after: dict[str, Optional[float]],
    weights: dict[str, float],
    watch: Optional[dict[str, str]] = None,
) -> list[tuple[str, str, str, str]]:
    """(label, before, after, change) rows shared by `lmppo eval` and the end-of-run summary; a `watch` source (a
    warning sign: higher is worse) is labelled so."""
    rows = [("score (training reward)", before.get("score"), after.get("score"), "+")]
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

    def fmt(v, sign):
        return "n/a" if v is None else (f"{v:+.3f}" if sign else f"{v:.3f}")

    out = []
    for label, b, a, sign in rows:
        change = "" if a is None or b is None else f"{a - b:+.3f}"
        out.append((label, fmt(b, sign), fmt(a, sign), change))
    return out


def win_rows(wins: dict[str, float], judge: str, watch: Optional[dict[str, str]] = None) -> list[tuple[str, ...]]:
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


def print_eval(result: dict[str, Any], console: Any, show: int = 3) -> None:
    where = "held-out" if result["held_out"] else "training (no held-out split)"
    k = result.get("samples_per_prompt", 1)
    table = Table(
        title=f"{result['model']} vs {result['start']}: {result['prompts']} {where} prompts x {k} "
        f"samples, T={result['temperature']:g}, seed {result['seed']}",
        title_justify="left",
    )
    for col, just in (("metric", "left"), ("start", "right"), ("trained", "right"), ("change", "right")):
        table.add_column(col, justify=just)
    watch = result.get("watch", {})
    for row in metric_rows(result["start_point"], result["trained"], result["weights"], watch):
        table.add_row(*row)
    for row in win_rows(result["win_rate_by_source"], result["judge"], watch):
        table.add_row(*row)
    console.print(table)
    if show > 0 and result["samples"]:
        firsts = result["samples"][::k][:show]  # the first response to each of the first prompts
        console.print(
            sample_comparison(
                firsts, "start", "trained", "the first held-out prompts: a response of each model, with its scores"
            )
        )


def sample_comparison(samples: list[dict[str, Any]], before_key: str, after_key: str, title: str = ""):
    """A rich table: prompt | response before | response after, each response followed by its scores."""
    table = Table(show_lines=True, title=title or None, title_justify="left", expand=True)
    table.add_column("prompt", overflow="fold", ratio=2)
    table.add_column(before_key, overflow="fold", ratio=3)
    table.add_column(after_key, overflow="fold", ratio=3)
    for s in samples:
        cells = []
        for key in (before_key, after_key):
            scores = s.get(f"{key}_scores", {})
            text = Text(s[key].strip() or "(empty)")
            if scores:
                text.append("\n" + "  ".join(f"{n} {v:+.2f}" for n, v in scores.items()), style="dim")
            cells.append(text)
        table.add_row(Text(s["prompt"]), *cells)
    return table
