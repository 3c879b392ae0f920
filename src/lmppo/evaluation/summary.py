"""The end-of-training summary: what training changed, measured on the held-out prompts (`data.holdout`).

It reads a `RunRecord` (what the trainer hands over: `PPOTrainer.run_record`), samples on the run's road
(`lmppo.episodes.road`) and returns the summary; the caller puts its table into the model cards (`card_table`).
Design notes: docs/design.md, `lmppo.evaluation.summary`."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional, TypedDict

from torch import nn

from lmppo.config import Config
from lmppo.data.prompts import PromptSet
from lmppo.episodes.road import Road
from lmppo.evaluation.heldout import (
    EvalChoices,
    EvalPrompts,
    PolicyEval,
    compare,
    repeat_columns,
    repeat_prompts,
    sample_and_score,
)
from lmppo.evaluation.tables import (
    ComparedPrompt,
    Means,
    add_metric_columns,
    default_judge,
    metric_rows,
    sample_comparison,
    watched,
    win_rows,
)
from lmppo.models.reference import adapters_disabled
from lmppo.run.layout import FINAL, SUMMARY
from lmppo.run.metrics_file import controller_beta, run_rows
from lmppo.run.model_card import HeldoutRows
from lmppo.run.storage import write_json

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from lmppo.models.reference import ReferencePolicy

NUM_SAMPLES = 3
"""Held-out prompts shown with their response before and after training."""
SAMPLES_PER_PROMPT = 4
"""Responses sampled per held-out prompt (each on its own random stream). With one, the before/after means of a
few dozen prompts move by about 0.1 from one seed to the next; four make the comparison steadier."""


class _TrainingCounts(TypedDict):
    iterations: int
    episodes: int
    train_seconds: float


class TrainingPart(_TrainingCounts, total=False):
    """The summary's `training`: the run's size, and its first and last iteration's metrics (from metrics.jsonl)."""

    first: dict[str, Optional[float]]
    last: dict[str, Optional[float]]


class SummarySample(TypedDict):
    prompt: str
    before: str  # "" when the initial policy was not sampled
    after: str
    before_scores: dict[str, float]
    after_scores: dict[str, float]


class _SummaryStart(TypedDict):
    output_dir: str
    training: TrainingPart


class RunSummary(_SummaryStart, total=False):
    """The end-of-run summary (`summary.json`): the held-out keys only when the run kept prompts out."""

    note: str  # why a part is missing (no held-out prompts; `before` not sampled)
    heldout_prompts: int
    samples_per_prompt: int
    temperature: float
    max_new_tokens: int
    seed: int
    judge: str
    weights: dict[str, float]
    watch: dict[str, str]
    before: Optional[Means]  # None: the initial policy was not sampled
    after: Means
    win_rate: Optional[dict[str, float]]  # by each source: after over before
    samples: list[SummarySample]


@dataclass
class RunRecord:
    """What the summary reads of a finished run (`PPOTrainer.run_record` builds it)."""

    config: Config  # the run's config: output_dir, seed, rollout settings, no_grad_batch_size
    road: Road  # the run's engine, precision and reward sources
    policy: nn.Module  # the trained policy
    reference: ReferencePolicy  # the KL's reference; also where the initial policy may still be found
    holdout_set: Optional[PromptSet]  # the held-out prompts (None or empty: data.holdout = 0)
    iteration: int  # completed iterations
    episode: int  # episodes trained on
    train_seconds: float
    history: list[dict[str, float]]  # this process's metrics rows (a resumed run's start at the resume)
    is_main_process: bool
    full_weights: Callable[[], AbstractContextManager[object]]  # ZeRO-3: the full weights on every process


@contextmanager
def initial_policy(run: RunRecord) -> Iterator[tuple[Optional[nn.Module], bool]]:
    """(a model that computes the initial policy, whether it is the reference), or (None, False) when the initial
    weights are no longer available (full weights with a `sync` / `ema` reference)."""
    ref, policy = run.reference, run.policy
    if ref.mode == "base":  # the base under the adapters: the initial policy only when the adapter started fresh
        if ref.initial_is_base:
            with adapters_disabled(policy):
                yield policy, True
        else:
            yield None, False
    elif ref.mode == "frozen":
        if ref.model is not None:
            yield ref.model, True
        else:
            with ref.as_reference(policy):
                yield policy, True
    elif ref.peft:
        with adapters_disabled(policy):
            yield policy, False
    else:
        yield None, False


def heldout_summary(
    run: RunRecord, num_samples: int = NUM_SAMPLES, samples_per_prompt: int = SAMPLES_PER_PROMPT
) -> RunSummary:
    """The summary as a JSON-able dict (see the module docstring). Without held-out prompts only the
    `training` part is filled in."""
    cfg = run.config
    out: RunSummary = {"output_dir": cfg.output_dir, "training": _training_part(run)}
    held = run.holdout_set
    if held is None or not len(held.ids):
        out["note"] = "no held-out prompts (data.holdout = 0): set data.holdout to compare before and after"
        return out
    r = cfg.rollout
    sources = run.road.sources
    weights = {s.name: float(s.weight) for s in sources}  # (an environment's reward is the source `environment`)
    watch = watched(sources)
    judge = default_judge(weights, watch)
    ids, texts = repeat_prompts(held.ids, held.texts, samples_per_prompt)
    prompts = EvalPrompts(ids, texts, repeat_columns(held.columns, samples_per_prompt))
    choices = EvalChoices.of_run(cfg, cfg.seed)
    policy = run.policy

    def reference_logits(input_ids: torch.Tensor, attention: torch.Tensor, P: int) -> torch.Tensor:
        return run.reference.logits(policy, input_ids, attention, P, r.temperature)

    after = sample_and_score(run.road, policy, prompts, choices, reference_logits)
    before = _before(run, prompts, choices)
    out.update(
        {
            "heldout_prompts": len(held.ids),
            "samples_per_prompt": samples_per_prompt,
            "temperature": r.temperature,
            "max_new_tokens": r.max_new_tokens,
            "seed": cfg.seed,
            "judge": judge,
            "weights": weights,
            "watch": watch,
            "before": before.means() if before is not None else None,
            "after": after.means(),
            "win_rate": compare(after, before) if before is not None else None,
        }
    )
    if before is None and not run.road.samples_any_model:
        out["note"] = (
            f"`before` not sampled: the sampling engine `{run.road.engine_name}` holds the trained policy's "
            "weights only (run `lmppo eval` with --rollout.backend native to compare with the start)"
        )
    shown = [p * samples_per_prompt for p in range(min(num_samples, len(held.ids)))]  # each prompt's first sample
    out["samples"] = [
        {
            "prompt": held.shown_text(i // samples_per_prompt),
            "before": before.responses[i] if before is not None else "",
            "after": after.responses[i],
            "before_scores": {k: float(v[i]) for k, v in before.scores.items()} if before else {},
            "after_scores": {k: float(v[i]) for k, v in after.scores.items()},
        }
        for i in shown
    ]
    return out


def _before(run: RunRecord, prompts: EvalPrompts, choices: EvalChoices) -> Optional[PolicyEval]:
    """The initial policy on the held-out prompts, on the run's road; None when its weights are gone or the
    engine samples only the trained policy."""
    if not run.road.samples_any_model:
        return None
    with initial_policy(run) as (model, is_reference):
        if model is None:
            return None
        before = sample_and_score(run.road, model, prompts, choices)
    if is_reference:  # the initial policy is the reference: its KL to it is 0 by definition
        before.kl_k1 = before.kl_k3 = before.kl_exact = before.total.new_zeros(before.total.shape)
    return before


def _training_part(run: RunRecord) -> TrainingPart:
    # the whole run: metrics.jsonl from iteration 1 (a resumed trainer's history starts at the resume)
    h = run_rows(run.config.output_dir, run.iteration) or run.history
    part: TrainingPart = {
        "iterations": run.iteration,
        "episodes": run.episode,
        "train_seconds": round(run.train_seconds, 1),
    }
    if h:
        keys = ("objective/scores", "objective/kl", "objective/kl_coef", "loss/kl_coef", "response/length_mean")
        part["first"] = {"iteration": h[0].get("iteration"), **{k: h[0].get(k) for k in keys if k in h[0]}}
        part["last"] = {"iteration": h[-1].get("iteration"), **{k: h[-1].get(k) for k in keys if k in h[-1]}}
        for name in h[-1]:
            if name.startswith("reward/") and name != "reward/num_invalid":
                part["first"][name], part["last"][name] = h[0].get(name), h[-1].get(name)
    return part


def print_summary(summary: RunSummary, console: Console) -> None:
    """The summary as rich tables (a training line, the before/after metrics, a few samples)."""
    from rich.table import Table

    t = summary["training"]
    if "first" in t:
        f, last = t["first"], t["last"]
        console.print(
            f"[bold]training[/]: iteration {f['iteration']} -> {last['iteration']}: score "
            f"{f['objective/scores']:+.3f} -> {last['objective/scores']:+.3f}, KL {f['objective/kl']:.2f} -> "
            f"{last['objective/kl']:.2f} nats, beta {controller_beta(f):.4f} -> "
            f"{controller_beta(last):.4f} ({t['episodes']} episodes, {t['train_seconds']:.0f} s)",
            highlight=False,
        )
    if "after" not in summary:
        if summary.get("note"):
            console.print(f"[dim]{summary['note']}[/]")
        return
    before = summary["before"] or {}
    k = summary.get("samples_per_prompt", 1)
    table = Table(
        title=f"held-out prompts ({summary['heldout_prompts']}), {k} sample{'s' * (k > 1)} each at T="
        f"{summary['temperature']:g}, seed {summary['seed']}",
        title_justify="left",
    )
    add_metric_columns(table, "before", "after")
    watch = summary.get("watch", {})
    for row in metric_rows(before, summary["after"], summary["weights"], watch):
        table.add_row(*row)
    wins = summary.get("win_rate")
    for row in win_rows(wins, summary["judge"], watch) if wins else []:
        table.add_row(*row)
    console.print(table)
    if summary.get("note"):  # e.g. why `before` was not sampled
        console.print(f"[dim]{summary['note']}[/]")
    if summary.get("samples"):
        console.print(
            sample_comparison(
                [
                    ComparedPrompt(s["prompt"], s["before"], s["after"], s["before_scores"], s["after_scores"])
                    for s in summary["samples"]
                ],
                "before",
                "after",
                "held-out prompts: a response before and after training (same random stream for both), with its scores",
            )
        )


def write_summary(summary: RunSummary, path: str) -> str:
    """Write the summary as JSON (atomically: a temporary name, then renamed); returns the path."""

    write_json(path, summary, "the summary (summary.json)", "the trained model and checkpoints are complete", indent=2)
    return path


def summarize(
    run: RunRecord,
    console: Optional[Console] = None,
    num_samples: int = NUM_SAMPLES,
    samples_per_prompt: int = SAMPLES_PER_PROMPT,
) -> Optional[RunSummary]:
    """Compute the summary, print it on `console` (if any) and write `OUTPUT_DIR/summary.json`; returns it.
    Only the main process does this (the others return None)."""
    if not run.is_main_process:
        return None
    summary = heldout_summary(run, num_samples, samples_per_prompt)
    path = write_summary(summary, os.path.join(run.config.output_dir, SUMMARY))
    if console is not None:
        print_summary(summary, console)
        console.print(f"summary in {path}; model in {os.path.join(run.config.output_dir, FINAL)}", highlight=False)
    return summary


def card_table(summary: Optional[RunSummary]) -> Optional[tuple[HeldoutRows, str]]:
    """(the before/after rows, their title) for the model cards; None without a held-out comparison."""
    if summary is None or "after" not in summary:
        return None
    k = summary["samples_per_prompt"]
    rows = metric_rows(summary["before"] or {}, summary["after"], summary["weights"], summary.get("watch"))
    title = (
        f"{summary['heldout_prompts']} held-out prompts (`data.holdout`), {k} sample{'s' * (k > 1)} each at "
        f"temperature {summary['temperature']:g}, seed {summary['seed']}; `before`: the initial policy."
    )
    return rows, title


def print_run_summary(run: RunRecord, console: Optional[Console]) -> Optional[RunSummary]:
    """What `lmppo train` prints at the end (`summarize`), announced, with the full weights on every process
    (ZeRO-3: each process samples with them); returns the summary (None on other processes)."""
    held = run.holdout_set
    if console is not None and held is not None and len(held.ids):
        console.print(
            f"[bold]done[/]; sampling the initial and the trained policy on the {len(held.ids)} held-out prompts ...",
            highlight=False,
        )
    with run.full_weights():
        return summarize(run, console)
