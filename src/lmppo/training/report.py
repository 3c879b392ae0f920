"""What one iteration reports: its metrics (TRL's names with TRL's meaning, plus lmppo's own; docs/metrics.md),
the held-out evaluation's `eval/*` and the rows of the sample table; and what a run reports at its end (the record
the summary reads, the summary, its table in the model cards)."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Optional, Protocol

import torch
from torch import nn

from lmppo.config import Config, LogConfig
from lmppo.core.masking import masked_sum
from lmppo.data.prompts import PromptSet
from lmppo.episodes.road import Road
from lmppo.evaluation.heldout import EvalChoices, EvalPrompts, sample_and_score
from lmppo.evaluation.summary import RunRecord, RunSummary, card_table, print_run_summary
from lmppo.run.layout import FINAL
from lmppo.run.model_card import card_folders
from lmppo.run.storage import write_text
from lmppo.training.batch import Rollout
from lmppo.training.episodes import episode_metrics
from lmppo.training.metrics import MetricsAccumulator
from lmppo.training.scoring import RewardSignal, ScoredRollout, TokenRewards
from lmppo.training.update import MEAN_STATS, loss_kl_estimator

if TYPE_CHECKING:
    from accelerate import Accelerator
    from rich.console import Console
    from transformers import PreTrainedTokenizerBase

    from lmppo.distributed.strategy import Strategy
    from lmppo.models.reference import ReferencePolicy
    from lmppo.run.model_card import HeldoutRows


@dataclass
class SignalWatch:
    """Says once, on the console, that `batches` batches in a row carried no reward signal (`ppo.signal_tolerance`):
    a run whose responses never earn a reward, or always the same one, trains nothing, and only
    `update/skipped_no_signal` in the metrics would tell."""

    tolerance: float
    batches: int = 3
    streak: int = 0
    said: bool = False

    def see(self, signal: Optional[RewardSignal]) -> None:
        if signal is None or signal.any:
            self.streak = 0
            return
        self.streak += 1
        if self.streak >= self.batches and not self.said:
            self.said = True
            warnings.warn(
                f"no reward signal in {self.streak} batches in a row: every response of a batch (of a prompt's group, "
                f"with rollout.num_samples_per_prompt > 1) scored the same, within ppo.signal_tolerance "
                f"({self.tolerance:g}), so the policy took no step; a reward that never varies (always 0?) trains "
                "nothing: look at the scores in samples.jsonl (log.sample_every)",
                stacklevel=2,
            )


def iteration_metrics(
    rollout: Rollout,
    scored: ScoredRollout,
    rewards: TokenRewards,
    stats: MetricsAccumulator,
    phase_seconds: dict[str, float],
    config: Config,
    strategy: Strategy,
    counters: dict[str, float],
    kl_coef: float,
    distorting: bool,
    kl_target: float | None = None,
) -> dict[str, float]:
    """The metrics of an iteration, averaged over all processes (`strategy`: means, sums and maxima over them).
    `counters`: episode, iteration, train_seconds, lr; `kl_coef`: the beta of this batch's rewards; `kl_target`: the
    KL per response the controller holds beta to (`kl.target`; None: a controller without one)."""
    procs = strategy
    gather = procs.gather_mean
    mask = rollout.policy_mask
    valid = scored.valid.float()
    kl_per_response = rewards.kl_reading.per_response
    beta = kl_coef if config.kl.placement in ("reward", "both") else 0.0
    non_score = -beta * kl_per_response
    scores = scored.token_scores.sum(1)
    episode = counters["episode"]
    m: dict[str, float] = {
        "episode": episode,
        "iteration": counters["iteration"],
        "eps": episode / max(counters["train_seconds"], 1e-9),
        "lr": counters["lr"],
        "objective/kl": rewards.kl_reading.mean,
        "objective/kl_coef": beta,
        **({"objective/kl_target": kl_target} if kl_target is not None else {}),
        **({"loss/kl_coef": kl_coef} if loss_kl_estimator(config) is not None else {}),  # beta of the loss's term
        "objective/entropy": gather(masked_sum(-rollout.logprobs, mask, dim=1)),
        "objective/non_score_reward": gather(non_score),
        "objective/scores": gather(scores),
        "objective/scores_raw": gather(scored.raw_scores),
        "objective/rlhf_reward": gather(scores + non_score),
        "val/num_eos_tokens": gather(rollout.terminated.float()) * rollout.batch_size * procs.accelerator.num_processes,
        "response/length_mean": gather(mask.sum(1).float()),
        "response/truncated_frac": gather(rollout.truncated.float()),
        "reward/num_invalid": procs.process_sum((1 - valid).sum()),
        f"truncation/{config.reward.truncation}_count": procs.process_sum(rollout.truncated.sum()),
        "objective/kl_token_min": -procs.process_max(-rewards.kl[mask].min() if mask.any() else torch.zeros(())),
    }
    for name, per_response in scored.per_source.items():
        m[f"reward/{name}"] = gather(per_response)
    if scored.overlong is not None:  # reward.overlong_buffer: the mean penalty added per response
        m["reward/overlong_penalty"] = gather(scored.overlong)
    if config.environment.path:  # multi-turn episodes: episode/*
        m.update(episode_metrics(rollout, gather))
    for name in MEAN_STATS:
        if name in stats:
            m[name] = procs.process_mean(stats.mean(name))
    if "ppo/updates" in stats:  # ppo.target_kl: optimizer steps taken, and whether the brake stopped them
        m["ppo/updates"] = float(stats.count("ppo/updates"))
        m["ppo/early_stop"] = stats.max("ppo/early_stop")
    if "val/ratio" in stats:
        m["val/ratio_var"] = procs.process_mean(stats.var("val/ratio"))
    if rewards.signal is not None:  # ppo.signal_tolerance: was the policy step skipped, and how many rows said nothing
        m["update/skipped_no_signal"] = float(not rewards.signal.any)
        rows_with_signal = procs.process_sum(rewards.signal.rows.sum())
        m["update/no_signal_frac"] = 1.0 - rows_with_signal / max(procs.process_sum(valid.sum()), 1.0)
        m["update/kl_pull"] = float("update/kl_pull" in stats)  # kl.pull_without_signal: the KL term stepped alone
    if "update/skipped_nonfinite" in stats:
        m["update/skipped_nonfinite"] = stats.mean("update/skipped_nonfinite") * stats.count("update/skipped_nonfinite")
    for phase, sec in phase_seconds.items():
        m[f"time/{phase}"] = sec
    tokens = (rollout.attention_mask.sum()).item()
    m["tokens_per_s"] = tokens / max(sum(phase_seconds.values()), 1e-9)
    if distorting:
        m["rollout/distorting_sampling"] = 1.0
    return m


def samples_due(log: LogConfig, iteration: int) -> bool:
    """Whether iteration `iteration` (1-based) writes a sample table: the first one, then every `log.sample_every`
    (never with `sample_every` or `num_samples` 0)."""
    return bool(log.sample_every and log.num_samples and (iteration % log.sample_every == 0 or iteration == 1))


def sample_rows(
    rollout: Rollout,
    scored: ScoredRollout,
    rewards: TokenRewards,
    tokenizer: PreTrainedTokenizerBase,
    num_samples: int,
    token_stats: bool,
) -> list[dict[str, object]]:
    """The first `num_samples` episodes as sample-table rows: prompt, response, score (and with `token_stats`, the
    KL and entropy of every response token)."""
    n = min(num_samples, rollout.batch_size)
    scores = scored.token_scores.sum(1)
    rows = []
    for i in range(n):
        row: dict[str, object] = {
            "prompt": rollout.prompts_shown[i],
            "response": rollout.episodes.side.shown[i],
            "score": float(scores[i]),
        }
        if token_stats:
            m = rollout.policy_mask[i]
            toks = tokenizer.convert_ids_to_tokens(rollout.response_ids[i][m].tolist())
            kl = rewards.kl[i][m].tolist()
            row["kl per token"] = " ".join(f"{t}({k:+.2f})" for t, k in zip(toks, kl))
            if rollout.entropy is not None:
                ent = rollout.entropy[i][m].tolist()
                row["entropy per token"] = " ".join(f"{t}({e:.2f})" for t, e in zip(toks, ent))
            row["kl"] = float(sum(kl))
        rows.append(row)
    return rows


def heldout_metrics(
    road: Road,
    policy: nn.Module,
    held: PromptSet,
    cfg: Config,
    reference: ReferencePolicy,
) -> dict[str, float]:
    """`eval/*`: one response per held-out prompt of `held` from `policy` on the run's road, sampled on the
    evaluation's own random streams (the training draws are untouched), scored by every source, with its KL to the
    reference and its length (`lmppo.evaluation.heldout`)."""
    temperature = cfg.rollout.temperature

    def reference_logits(input_ids: torch.Tensor, attention: torch.Tensor, P: int) -> torch.Tensor:
        return reference.logits(policy, input_ids, attention, P, temperature)

    prompts = EvalPrompts(held.ids, held.texts, held.columns or None)
    choices = EvalChoices.of_run(cfg, cfg.seed)
    result = sample_and_score(road, policy, prompts, choices, reference_logits)
    return {f"eval/{k}": v for k, v in result.means().items() if v is not None}


class FinishedRun(Protocol):
    """What the end of a run reads of `lmppo.training.trainer.PPOTrainer` (which imports this module); read-only
    properties, so the trainer's narrower types (the policy a `PreTrainedModel | PeftModel`) fit."""

    @property
    def config(self) -> Config: ...
    @property
    def policy(self) -> nn.Module: ...
    @property
    def reference(self) -> ReferencePolicy: ...
    @property
    def holdout_set(self) -> Optional[PromptSet]: ...
    @property
    def iteration(self) -> int: ...
    @property
    def episode(self) -> int: ...
    @property
    def train_seconds(self) -> float: ...
    @property
    def history(self) -> list[dict[str, float]]: ...
    @property
    def accelerator(self) -> Accelerator: ...
    @property
    def strategy(self) -> Strategy: ...
    @property
    def actor(self) -> nn.Module: ...
    def road(self) -> Road: ...
    def model_card(self, folder: str, heldout: Optional[HeldoutRows] = None, heldout_title: str = "") -> str: ...


def run_record(trainer: FinishedRun) -> RunRecord:
    """What the end-of-run summary reads of `trainer`'s run (`lmppo.evaluation.summary.RunRecord`)."""
    return RunRecord(
        config=trainer.config,
        road=trainer.road(),
        policy=trainer.policy,
        reference=trainer.reference,
        holdout_set=trainer.holdout_set,
        iteration=trainer.iteration,
        episode=trainer.episode,
        train_seconds=trainer.train_seconds,
        history=trainer.history,
        is_main_process=trainer.accelerator.is_main_process,
        full_weights=partial(trainer.strategy.full_weights, trainer.actor),
    )


def summarize_run(trainer: FinishedRun, console: Optional[Console] = None) -> Optional[RunSummary]:
    """The end-of-run summary (`lmppo.evaluation.summary`), printed on `console`, its held-out table written into
    the final model cards; None on processes other than the main one."""
    summary = print_run_summary(run_record(trainer), console)
    final, table = os.path.join(trainer.config.output_dir, FINAL), card_table(summary)
    if table is not None and os.path.isdir(final):
        rows, title = table
        for folder in card_folders(final):
            text = trainer.model_card(folder, rows, title)
            write_text(os.path.join(final, folder, "README.md"), text, "the model card")
    return summary
