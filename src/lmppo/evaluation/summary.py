"""The end-of-training summary: what training changed, measured on the held-out prompts (`data.holdout`).

Design notes: docs/design.md, `lmppo.evaluation.summary`."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from lmppo.evaluation.heldout import PolicyEval, compare, repeat_columns, repeat_prompts, sample_and_score
from lmppo.evaluation.tables import default_judge, metric_rows, sample_comparison, watched, win_rows
from lmppo.run.metrics_file import run_rows
from lmppo.run.storage import write_json

NUM_SAMPLES = 3
"""Held-out prompts shown with their response before and after training."""
SAMPLES_PER_PROMPT = 4
"""Responses sampled per held-out prompt (each on its own random stream). With one, the before/after means of a
few dozen prompts move by about 0.1 from one seed to the next; four make the comparison steadier."""


@contextmanager
def initial_policy(trainer: Any) -> Iterator[tuple[Optional[Any], bool]]:
    """(a model that computes the initial policy, whether it is the reference), or (None, False) when the initial
    weights are no longer available (full weights with a `sync` / `ema` reference)."""
    ref, policy = trainer.reference, trainer.policy
    if ref.mode == "base":  # the base under the adapters: the initial policy only when the adapter started fresh
        if ref.initial_is_base:
            with policy.disable_adapter():
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
        with policy.disable_adapter():
            yield policy, False
    else:
        yield None, False


def heldout_summary(
    trainer: Any, num_samples: int = NUM_SAMPLES, samples_per_prompt: int = SAMPLES_PER_PROMPT
) -> dict[str, Any]:
    """The summary as a JSON-able dict (see the module docstring). Without held-out prompts only the
    `training` part is filled in."""
    cfg = trainer.config
    out: dict[str, Any] = {"output_dir": cfg.output_dir, "training": _training_part(trainer)}
    held = trainer.holdout_set
    if held is None or not len(held.ids):
        out["note"] = "no held-out prompts (data.holdout = 0): set data.holdout to compare before and after"
        return out
    r = cfg.rollout
    player = trainer.episode_source.player if getattr(trainer, "episode_source", None) else None
    weights = {s.name: float(s.weight) for s in trainer.reward_sources} | ({"environment": 1.0} if player else {})
    watch = watched(trainer.reward_sources)
    judge = default_judge(weights, watch)
    common = dict(
        tokenizer=trainer.tokenizer,
        sources=trainer.reward_sources,
        temperature=r.temperature,
        max_new_tokens=r.max_new_tokens,
        stop_ids=trainer.stop_ids,
        seed=cfg.seed,
        backend="hf" if r.backend == "hf" else "native",
        batch_size=cfg.no_grad_batch_size,
        autocast=trainer._autocast,
        columns=repeat_columns(held.columns, samples_per_prompt),
        episodes=player,  # an environment: one episode per prompt, `reward/environment` its success
    )
    policy = trainer.policy

    def reference_logits(input_ids, attention, P):
        return trainer.reference.logits(policy, input_ids, attention, P, r.temperature)

    ids, texts = repeat_prompts(held.ids, held.texts, samples_per_prompt)
    after = sample_and_score(policy, ids, texts, reference_logits=reference_logits, **common)
    before: Optional[PolicyEval] = None
    with initial_policy(trainer) as (model, is_reference):
        if model is not None:
            before = sample_and_score(model, ids, texts, **common)
            if is_reference:  # the initial policy is the reference: its KL to it is 0 by definition
                before.kl_k1 = before.kl_k3 = before.kl_exact = before.total.new_zeros(before.total.shape)
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
    shown = [p * samples_per_prompt for p in range(min(num_samples, len(held.ids)))]  # each prompt's first sample
    out["samples"] = [
        {
            "prompt": held.shown_text(i // samples_per_prompt) if player is None else after.prompts[i],
            "before": before.responses[i] if before is not None else "",
            "after": after.responses[i],
            "before_scores": {k: float(v[i]) for k, v in before.scores.items()} if before else {},
            "after_scores": {k: float(v[i]) for k, v in after.scores.items()},
        }
        for i in shown
    ]
    return out


def _training_part(trainer: Any) -> dict[str, Any]:
    # the whole run: metrics.jsonl from iteration 1 (a resumed trainer's history starts at the resume)
    h = run_rows(trainer.config.output_dir, trainer.iteration) or trainer.history
    part: dict[str, Any] = {
        "iterations": trainer.iteration,
        "episodes": trainer.episode,
        "train_seconds": round(trainer.train_seconds, 1),
    }
    if h:
        keys = ("objective/scores", "objective/kl", "objective/kl_coef", "response/length_mean")
        part["first"] = {"iteration": h[0].get("iteration"), **{k: h[0].get(k) for k in keys if k in h[0]}}
        part["last"] = {"iteration": h[-1].get("iteration"), **{k: h[-1].get(k) for k in keys if k in h[-1]}}
        for name in h[-1]:
            if name.startswith("reward/") and name != "reward/num_invalid":
                part["first"][name], part["last"][name] = h[0].get(name), h[-1].get(name)
    return part


def print_summary(summary: dict[str, Any], console: Any) -> None:
    """The summary as rich tables (a training line, the before/after metrics, a few samples)."""
    from rich.table import Table

    t = summary["training"]
    if "first" in t:
        f, last = t["first"], t["last"]
        console.print(
            f"[bold]training[/]: iteration {f['iteration']} -> {last['iteration']}: score "
            f"{f['objective/scores']:+.3f} -> {last['objective/scores']:+.3f}, KL {f['objective/kl']:.2f} -> "
            f"{last['objective/kl']:.2f} nats, beta {f.get('objective/kl_coef', 0):.4f} -> "
            f"{last.get('objective/kl_coef', 0):.4f} ({t['episodes']} episodes, {t['train_seconds']:.0f} s)",
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
    for col, just in (("metric", "left"), ("before", "right"), ("after", "right"), ("change", "right")):
        table.add_column(col, justify=just)
    watch = summary.get("watch", {})
    for row in metric_rows(before, summary["after"], summary["weights"], watch):
        table.add_row(*row)
    for row in win_rows(summary["win_rate"], summary["judge"], watch) if summary.get("win_rate") else []:
        table.add_row(*row)
    console.print(table)
    if summary.get("samples"):
        console.print(
            sample_comparison(
                summary["samples"],
                "before",
                "after",
                "held-out prompts: a response before and after training (same random stream for both), with its scores",
            )
        )


def write_summary(summary: dict[str, Any], path: str) -> str:
    """Write the summary as JSON (atomically: a temporary name, then renamed); returns the path."""

    write_json(path, summary, "the summary (summary.json)", "the trained model and checkpoints are complete", indent=2)
    return path


def summarize(
    trainer: Any, console: Any = None, num_samples: int = NUM_SAMPLES, samples_per_prompt: int = SAMPLES_PER_PROMPT
) -> Optional[dict[str, Any]]:
    """Compute the summary, print it on `console` (if any) and write `OUTPUT_DIR/summary.json`; returns it.
    Only the main process does this (the others return None)."""
    if not trainer.accelerator.is_main_process:
        return None
    summary = heldout_summary(trainer, num_samples, samples_per_prompt)
    path = write_summary(summary, os.path.join(trainer.config.output_dir, "summary.json"))
    final = os.path.join(trainer.config.output_dir, "final")
    if "after" in summary and os.path.isdir(final) and hasattr(trainer, "rewrite_model_cards"):
        k = summary["samples_per_prompt"]
        trainer.rewrite_model_cards(
            final,
            metric_rows(summary["before"] or {}, summary["after"], summary["weights"], summary.get("watch")),
            f"{summary['heldout_prompts']} held-out prompts (`data.holdout`), {k} "
            f"sample{'s' * (k > 1)} each at temperature {summary['temperature']:g}, seed "
            f"{summary['seed']}; `before`: the initial policy.",
        )
    if console is not None:
        print_summary(summary, console)
        console.print(
            f"summary in {path}; model in {os.path.join(trainer.config.output_dir, 'final')}", highlight=False
        )
    return summary


def print_run_summary(trainer: Any, console: Any) -> None:
    """What `lmppo train` prints at the end (`summarize`), announced, with the full weights on every process
    (ZeRO-3: each process samples with them)."""
    held = getattr(trainer, "holdout_set", None)
    if console is not None and held is not None and len(held.ids):
        console.print(
            f"[bold]done[/]; sampling the initial and the trained policy on the {len(held.ids)} held-out prompts ...",
            highlight=False,
        )
    with trainer.strategy.full_weights(trainer.actor):
        summarize(trainer, console)
