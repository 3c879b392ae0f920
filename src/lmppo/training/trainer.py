"""PPOTrainer: the loop of the six phases of one PPO iteration for a causal LM (after Huang et al. 2024, "The N+
Implementation Details of RLHF with PPO"). How it departs from TRL 1.12: docs/design.md, `lmppo.training.trainer`.
"""

from __future__ import annotations

import os
import time
import weakref
from contextlib import nullcontext
from functools import partial
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from torch import nn

import lmppo.run.lock as lock
from lmppo.config import Config
from lmppo.core.rewards import RunningMoments
from lmppo.environments.road import run_road
from lmppo.episodes.road import Road
from lmppo.quiet import quiet_libraries
from lmppo.run.export import export_final, final_card, warn_unmerged
from lmppo.run.layout import FINAL
from lmppo.run.model_card import HeldoutRows
from lmppo.sampling.engines import SamplingEngine, build_sampling_engine
from lmppo.training import compiled_update, report, rollout, scoring
from lmppo.training.assembly import Components, build_components
from lmppo.training.batch import Rollout
from lmppo.training.callbacks import callback_list
from lmppo.training.inputs import Fingerprints
from lmppo.training.metrics import MetricsAccumulator, MetricsLogger, PhaseTimer, open_logger, warn_negative_kl
from lmppo.training.progress import ProgressDisplay
from lmppo.training.resume import checkpoint_trainer, load_trainer_checkpoint, resume_trainer
from lmppo.training.scoring import KLReading, RewardSignal, ScoredRollout, TokenRewards
from lmppo.training.update import UpdateBatch
from lmppo.training.updater import Updater

if TYPE_CHECKING:
    from peft import PeftModel
    from rich.console import Console
    from transformers import PreTrainedModel, PreTrainedTokenizerBase
    from typing_extensions import Self, Unpack

    from lmppo.environments.factories import Factories
    from lmppo.training.resume import TrainerObjects


class PPOTrainer:
    """Train `config.model.policy` with PPO. Objects passed in replace what the config would load:

    policy / tokenizer: an HF causal LM and its tokenizer; prompts: a list of strings, chat message lists or
    token-id lists, or a `datasets.Dataset` (its `data.field` column); reward_functions: callables
    `fn(prompts, completions) -> list` (or a name -> callable dict, or `lmppo.rewards.RewardSource` objects), used in
    addition to the config's reward sources (the config's default source is dropped when any are given);
    value_model: a decoder `*ForSequenceClassification` model (one label) used as the critic as given, its backbone
    and `score` head (needs value.mode `critic`); ref_model: the reference policy's model, used as given and frozen
    (reference.mode `frozen`), instead of a copy of the initial policy;
    callbacks: objects with some of the hooks of `lmppo.training.callbacks.Callback` (on_log, on_iteration_end,
    on_save, ...); environment_factory: an environment class (TRL 1.16's `environment_factory` shape or lmppo's,
    docs/environments.md), or a name -> class dict picked per prompt row by its `environment` column, instead of
    `environment.path`; tools: functions offered as tools in every episode, besides `environment.tools` (the config
    names both `python:...`; pass them again to resume).

    Construction from the config is the assembly step (`lmppo.training.assembly.build_components`); `components=` takes
    ready ones instead (then `config` is `components.config` and the other objects are not used). `resuming`:
    the output folder already holds this run (`PPOTrainer.resume`).
    """

    def __init__(
        self,
        config: Config,
        *,
        policy: Optional[nn.Module] = None,
        tokenizer: Optional[PreTrainedTokenizerBase] = None,
        prompts: Optional[Sequence] = None,
        reward_functions: dict[str, Callable] | Sequence[Callable] | None = None,
        console: Optional[Console] = None,
        value_model: Optional[nn.Module] = None,
        ref_model: Optional[nn.Module] = None,
        resuming: bool = False,
        components: Optional[Components] = None,
        callbacks: object = None,
        environment_factory: Optional[Factories] = None,
        tools: Sequence[Callable] = (),
    ):
        quiet_libraries()  # library noise off, as in the CLI (lmppo.quiet)
        # the assembly step (lmppo.training.assembly): models, data, rewards, optimizer from the config
        c = components or build_components(
            config,
            policy=policy,
            tokenizer=tokenizer,
            prompts=prompts,
            reward_functions=reward_functions,
            value_model=value_model,
            ref_model=ref_model,
            console=console,
            resuming=resuming,
            environment_factory=environment_factory,
            tools=tools,
        )
        self.config = cfg = c.config
        self.console = console
        self.accelerator, self.strategy, self.device = c.accelerator, c.strategy, c.accelerator.device
        self.precision, self.distorting = c.precision, c.distorting
        self.tokenizer, self.stop_ids = c.tokenizer, c.stop_ids
        self.actor, self.critic, self.reference = c.actor, c.critic, c.reference
        self.prompt_set, self.holdout_set, self.stream = c.prompt_set, c.holdout_set, c.stream
        self.reward_sources, self.kl_controller = c.reward_sources, c.kl_controller
        self.sampling_engines: dict[str, SamplingEngine] = dict(c.sampling_engines)  # built on first use
        self.environment = c.environment  # the run's environment as loaded (`run_road` plays it), or None
        self.roads: dict[str, Road] = {}  # the run's road for each engine (`road`)
        self.base_model, self.prompt_source = c.base_model, c.prompt_source  # as the model cards name them
        self.score_moments = RunningMoments()
        self.updater = Updater(c, self._autocast)  # phase 5 and its state (optimizer, generator, kept forward)
        self.iteration = 0  # completed iterations
        self.episode = 0  # episodes trained on
        self.train_seconds = 0.0
        self.fingerprints = Fingerprints(c.input_fingerprints)  # frozen weights and inputs, which a resume checks
        self.history: list[dict[str, float]] = []
        self.logger: Optional[MetricsLogger] = None
        self.progress = ProgressDisplay()
        self.callbacks = callback_list(callbacks)
        self.stop_requested = False  # set by `stop()` (a callback): the loop ends after the current iteration
        self.signal_watch = report.SignalWatch(cfg.ppo.signal_tolerance)  # one console line: nothing is trained
        if self.accelerator.is_main_process:  # the run-folder lock (taken by the assembly) is held while this lives
            weakref.finalize(self, lock.release, cfg.output_dir)

    # ------------------------------------------------------------------ the loop
    def train(self) -> list[dict[str, float]]:
        """Run the remaining iterations; returns the metrics of every iteration."""
        cfg = self.config
        if self.logger is None and self.accelerator.is_main_process:
            self.logger = open_logger(cfg, self.console, append=self.iteration > 0)
        self.callbacks.call("on_train_begin", self)
        started = time.perf_counter() - self.train_seconds
        try:
            while self.iteration < cfg.num_iterations and not self.stop_requested:
                timer, stats = PhaseTimer(), MetricsAccumulator()
                with timer("rollout"):
                    batch = self.collect_rollout()  # 1. generate, logprobs, reference, values
                with timer("score"):
                    scored = self.score(batch)  # 2. reward sources -> placed scores
                with timer("rewards"):
                    signal = scoring.reward_signal(batch, scored, cfg.ppo.signal_tolerance, self.strategy)
                    if self.accelerator.is_main_process:
                        self.signal_watch.see(signal)
                    kl = self.read_kl(batch)  # reduced once: the rewards, the controller and the metrics read it
                    if scoring.kl_reacts_now(cfg.kl):
                        self.adapt_kl_coef(kl, signal)  # beta answers this batch's own KL (kl.react: now)
                    rewards = self.token_rewards(batch, scored, signal, kl)  # 3. scores - beta * KL, truncation
                with timer("advantages"):
                    advantages, returns = self.advantages(batch, rewards)  # 4. GAE, whitening
                with timer("update"):  # 5. PPO epochs
                    self.updater.update(UpdateBatch(batch, advantages, returns, rewards.train_mask), stats, signal.any)
                compiled_update.split_compile_time(self.updater.compiled, timer.seconds)  # `time/compile`, when it ran
                self.train_seconds = time.perf_counter() - started
                self.finish_iteration(batch, scored, rewards, stats, timer)  # 6. log, adapt KL, sync ref
        finally:
            self.progress.close()
            if self.logger is not None:
                self.logger.close()
                self.logger = None
        self.save_model(os.path.join(cfg.output_dir, FINAL))
        self.callbacks.call("on_train_end", self, self.history)
        return self.history

    def stop(self) -> None:
        """End training after the current iteration (its checkpoint and the final model are written as usual)."""
        self.stop_requested = True

    # ------------------------------------------------------------------ 1. rollout
    @property
    def policy(self) -> PreTrainedModel | PeftModel:
        return self.accelerator.unwrap_model(self.actor).policy

    def collect_rollout(self) -> Rollout:
        """This process's share of the batch: prompts from the stream, each sampled `num_samples_per_prompt`
        times, with the logprobs, reference logprobs and values of the rollout's weights (`lmppo.training.rollout`)."""
        cfg, acc = self.config, self.accelerator
        k, rank = cfg.rollout.num_samples_per_prompt, acc.process_index
        prompts = self.stream.next_batch(rank, acc.num_processes)  # this process's slice
        index = [i for i in prompts for _ in range(k)]  # each prompt k times, consecutive
        batch, group_ids = rollout.prompt_batch(
            index,
            self.prompt_set,
            cfg,
            iteration=self.iteration,
            first_row=rank * len(index),  # rows of the global batch held by this process start here
            pad_id=self.tokenizer.pad_token_id,
            device=self.device,
        )
        # sampling runs in the same precision as the logprob passes below (bf16 autocast: 2.7x faster
        # generation on SmolLM2 here, benchmarks/speed/sampler_speed.py); with an environment: whole episodes
        with self.strategy.generation(self.actor):
            to_sample = rollout.episode_prompts(batch, index, self.prompt_set)
            sampled = self.road().episodes(self.policy, to_sample)
        prompt_ids, prompt_mask = sampled.prompts.batch.ids, sampled.prompts.batch.mask
        ids = torch.cat([prompt_ids, sampled.response_ids], 1)  # (B, P + T)
        mask = torch.cat([prompt_mask, sampled.response_mask], 1)
        B = ids.shape[0]
        chunk = cfg.rollout.forward_batch_size or B
        reuse = rollout.reuses_rollout_forward(cfg, self.strategy.reuses_rollout_forward, acc.num_processes, B, chunk)
        reference_logits = partial(self.reference.logits, self.policy, temperature=cfg.rollout.temperature)
        policy_and_values = partial(self.updater.rollout_forward, keep_graph=reuse)
        with self._autocast():
            passes = rollout.rollout_passes(
                ids, mask, sampled.response_ids, cfg, reference_logits, policy_and_values, chunk
            )
        return rollout.build_rollout(sampled, passes, group_ids, index, self.prompt_set)

    def road(self) -> Road:
        """The run's road (`lmppo.environments.road.run_road`: `rollout.backend`'s engine, the run's environment and
        reward sources), which training, every evaluation and the TRL drop-in take; built once per engine."""
        name = self.config.rollout.backend
        if name not in self.roads:
            engine, stops, sources = self.sampling_engine(name), self.stop_ids.tolist(), self.reward_sources
            self.roads[name] = run_road(
                self.config, engine, self.tokenizer, stops, sources, self._autocast, self.environment
            )
        return self.roads[name]

    def sampling_engine(self, name: Optional[str] = None) -> SamplingEngine:
        """The engine of `rollout.backend` (or `name`), built on first use (its registry: lmppo.sampling.engines)."""
        name = name or self.config.rollout.backend
        if name not in self.sampling_engines:
            self.sampling_engines[name] = build_sampling_engine(
                name, self.config, self.stop_ids, self.tokenizer.pad_token_id, self.accelerator
            )
        return self.sampling_engines[name]

    # ------------------------------------------------------------------ 2. - 4. score, rewards, advantages
    def score(self, batch: Rollout) -> ScoredRollout:
        """The road scores the rollout's episodes; then normalisation and the truncation policy (`scoring.score`)."""
        cfg = self.config
        result = self.road().score(batch.episodes, cfg.reward.on_bad_output)
        return scoring.score(batch, result, cfg.reward, self.score_moments, self.device, cfg.rollout)

    def read_kl(self, batch: Rollout) -> KLReading:
        """The batch's KL to the reference per token, per response and its mean over all processes (`objective/kl`)."""
        return scoring.read_kl(batch, self.config.kl.estimator, self.strategy.gather_mean)

    def adapt_kl_coef(self, kl: KLReading, signal: Optional[RewardSignal] = None) -> None:
        """The KL controller answers this batch's KL (`kl.react: now`); beta holds on a batch without a reward signal
        (no policy step: its KL says nothing about beta, and reading it would only wind the controller down)."""
        if signal is None or signal.any:
            self.kl_controller.update(kl.mean)

    def token_rewards(
        self,
        batch: Rollout,
        scored: ScoredRollout,
        signal: Optional[RewardSignal] = None,
        kl: Optional[KLReading] = None,
    ) -> TokenRewards:
        signal = signal or scoring.reward_signal(batch, scored, self.config.ppo.signal_tolerance, self.strategy)
        kl_reading = kl or self.read_kl(batch)
        return scoring.token_rewards(batch, scored, self.config, self.kl_controller.coef, kl_reading, signal)

    def advantages(self, batch: Rollout, rewards: TokenRewards) -> tuple[torch.Tensor, torch.Tensor]:
        return scoring.advantages(batch, rewards, self.config, self.strategy.whiten, self.strategy.gather_std)

    # ------------------------------------------------------------------ 6. log, adapt, sync
    def finish_iteration(
        self,
        batch: Rollout,
        scored: ScoredRollout,
        rewards: TokenRewards,
        stats: MetricsAccumulator,
        timer: PhaseTimer,
    ) -> None:
        cfg = self.config
        self.iteration += 1
        self.episode += cfg.rollout.batch_size  # global: every process's responses
        measured_kl = rewards.kl_reading.mean
        metrics = report.iteration_metrics(
            batch,
            scored,
            rewards,
            stats,
            timer.seconds,
            config=cfg,
            strategy=self.strategy,
            counters=dict(
                episode=self.episode,
                iteration=self.iteration,
                train_seconds=self.train_seconds,
                lr=self.updater.last_lr,
            ),
            kl_coef=self.kl_controller.coef,
            distorting=bool(self.distorting),
            kl_target=getattr(self.kl_controller, "target", None),  # (a plug-in controller may have none)
        )
        if cfg.log.eval_every and self.iteration % cfg.log.eval_every == 0:
            metrics.update(self.evaluate_heldout())  # eval/*: the policy on the held-out prompts
        metrics.update(scoring.retire_settled(self.stream, batch, scored, rewards, self.strategy))  # difficulty filter
        # kl.react next: beta answers this batch's KL for the next batch; it holds on a batch without a signal
        if not scoring.kl_reacts_now(self.config.kl) and (rewards.signal is None or rewards.signal.any):
            self.kl_controller.update(measured_kl)
        if self.reference.after_iteration(self.iteration, self.policy):
            metrics["reference/updated"] = 1.0
        warn_negative_kl(measured_kl, cfg.kl.warn_below, rewards.kl, batch.policy_mask, batch.episodes.side.texts)
        self.history.append(metrics)
        if self.logger is not None:  # the main process writes metrics, samples and the console
            self.logger.log(metrics, self.episode)
            self.progress.show(
                self.console,
                cfg.log.progress,
                self.iteration,
                cfg.num_iterations,
                self.episode,
                self.train_seconds,
                metrics,
            )
            self.callbacks.call("on_log", self, dict(metrics))
            if report.samples_due(cfg.log, self.iteration):
                rows = self.sample_rows(batch, scored, rewards)
                self.logger.log_samples(rows, self.episode, f"samples at episode {self.episode}")
        self.callbacks.call("on_iteration_end", self, metrics)
        # a callback may have called stop() on one process only (on_log runs on the main one): all agree
        self.stop_requested = bool(self.strategy.process_max(torch.tensor(float(self.stop_requested))))
        every, last = cfg.checkpoint.every, self.iteration == cfg.num_iterations
        if (every and self.iteration % every == 0) or last or self.stop_requested:
            self.save_checkpoint()  # always after the last iteration, so a finished run can be extended

    def evaluate_heldout(self) -> dict[str, float]:
        """`eval/*` of the current policy on the held-out prompts (`lmppo.training.report.heldout_metrics`); {}
        without held-out prompts and on processes other than the main one."""
        if self.holdout_set is None or not len(self.holdout_set.ids):
            return {}
        with self.strategy.full_weights(self.actor):  # ZeRO-3: the full weights, as for the end-of-run summary
            if not self.accelerator.is_main_process:
                return {}
            metrics = report.heldout_metrics(self.road(), self.policy, self.holdout_set, self.config, self.reference)
        self.callbacks.call("on_evaluate", self, dict(metrics))
        return metrics

    def sample_rows(self, batch: Rollout, scored: ScoredRollout, rewards: TokenRewards) -> list[dict[str, object]]:
        log = self.config.log
        return report.sample_rows(batch, scored, rewards, self.tokenizer, log.num_samples, log.token_stats)

    # ------------------------------------------------------------------ saving and resuming
    def save_model(self, directory: str) -> None:
        """The trained policy (and value model) in Hugging Face format with safetensors, written atomically, each
        folder with its model card; a LoRA policy also merged into full weights (`model.lora.save_merged`)."""
        if self.accelerator.is_main_process:
            warn_unmerged(self.config.model, self.policy)
        with self.strategy.saving(self.actor):  # ZeRO-3: every process gathers the full weights for the save
            if self.accelerator.is_main_process:
                export_final(
                    directory,
                    config=self.config,
                    policy=self.policy,
                    tokenizer=self.tokenizer,
                    value_head=self.accelerator.unwrap_model(self.actor).value_head,
                    value_model=self.accelerator.unwrap_model(self.critic).model if self.critic is not None else None,
                    base_model=self.base_model,
                    cards=self.model_card,
                )
                self.callbacks.call("on_save", self, directory)

    def model_card(self, folder: str, heldout: Optional[HeldoutRows] = None, heldout_title: str = "") -> str:
        """The README.md text of `final/<folder>` (`lmppo.run.export.final_card`); `heldout`: the before/after rows."""
        return final_card(
            folder,
            config=self.config,
            base_model=self.base_model,
            policy=self.policy,
            iterations=self.iteration,
            rewards=[(source.name, float(source.weight)) for source in self.road().sources],  # (an environment's too)
            prompt_source=self.prompt_source,
            heldout=heldout,
            heldout_title=heldout_title,
        )

    def save_checkpoint(self) -> Optional[str]:
        path = checkpoint_trainer(self)  # (sharded under DeepSpeed: `lmppo.distributed.strategy`)
        if self.accelerator.is_main_process:
            self.callbacks.call("on_save", self, path)
        return path

    @classmethod
    def resume(
        cls,
        output_dir: str,
        *,
        config: Optional[Config] = None,
        overrides: Optional[dict] = None,
        console: Optional[Console] = None,
        **kwargs: Unpack[TrainerObjects],
    ) -> Self:
        """A trainer that continues the run in `output_dir` from its latest complete checkpoint; call `train()`.

        `config` (default: the run's own config.yaml) with `overrides` ({"total_episodes": 2048}) may change
        harmless fields (extend the run, logging); a change that makes the checkpoint unusable raises ConfigError.
        `kwargs` (policy, tokenizer, prompts, reward_functions) as for a new run: the same initial policy and
        prompts the run started with (a policy object trained in place by the first run is not that)."""
        return resume_trainer(
            output_dir, overrides=overrides, console=console, config=config, trainer_cls=cls, **kwargs
        )

    def load_checkpoint(self, path: Optional[str] = None) -> str:
        """Restore this trainer from a checkpoint folder, or from the latest complete checkpoint of a run folder
        (default: this run's output_dir); returns the folder used. metrics.jsonl / samples.jsonl of the
        output_dir are cut back to the checkpoint's iteration (docs/checkpoints.md)."""
        return load_trainer_checkpoint(self, path)

    # ------------------------------------------------------------------ helpers
    def _autocast(self):
        if self.config.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return nullcontext()


if TYPE_CHECKING:  # the trainer is what the end of a run reads (a Protocol: report.py importing it would be a cycle)
    _ends_a_run: type[report.FinishedRun] = PPOTrainer
