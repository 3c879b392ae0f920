"""PPOTrainer: the loop of the six phases of one PPO iteration for a causal LM.

After "The N+ Implementation Details of RLHF with PPO" (Huang et al. 2024). How this departs from TRL 1.12:
- the score lands on the last real response token (the stop token), never on a padding slot;
- logprobs, reference logprobs and values come from one trunk pass each (the LM head only at response
  positions), under `inference_mode`, and the shared value head needs no second pass at all; with one minibatch
  of one micro-batch the policy/value pass keeps its graph and is the first epoch's forward
  (`ppo.reuse_rollout_forward`), where TRL runs it again;
- the loss is a token mean over the whole minibatch, identical whatever the micro-batch split;
- gradient clipping is applied; non-finite updates are skipped and counted;
- every metric is averaged over all processes, not only the local one.
"""

from __future__ import annotations

import os
import time
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn

import lmppo.run.lock as lock
from lmppo.config import Config, hub_repo_id
from lmppo.core.advantages import ADVANTAGE_ESTIMATORS
from lmppo.core.batch import Rollout
from lmppo.core.kl import KL_ESTIMATORS, exact_kl, next_state_kl
from lmppo.core.logprobs import entropy_from_logits, selective_log_softmax
from lmppo.core.masking import masked_sum
from lmppo.core.objective import LOSS_KL_ESTIMATOR, ppo_objective
from lmppo.core.rewards import (
    RunningMoments,
    bootstrap_truncated,
    kl_penalized_rewards,
    normalize_scores,
    penalize_truncated,
    unfinished_scores,
)
from lmppo.data.prompts import split_holdout  # noqa: F401  (re-exported: its home was here)
from lmppo.errors import TrainingError
from lmppo.evaluation.heldout import sample_and_score
from lmppo.models.loading import PolicyOutput, is_peft_model
from lmppo.models.optim import lr_factor, make_adamw  # noqa: F401  (make_adamw re-exported: its home was here)
from lmppo.quiet import quiet_libraries
from lmppo.rewards import decode_completion, score_rollout
from lmppo.run.config_file import redacted_config_dict
from lmppo.run.export import export_model, warn_unmerged, writes_merged
from lmppo.run.model_card import card_folders, card_text
from lmppo.run.storage import write_text
from lmppo.sampling.engines import PromptBatch, SamplingEngine, build_sampling_engine
from lmppo.sampling.hf import left_pad
from lmppo.sampling.native import response_seed
from lmppo.training.assembly import Components, build_components, prompts_per_iteration
from lmppo.training.callbacks import callback_list
from lmppo.training.metrics import MetricsAccumulator, MetricsLogger, make_trackers, warn_negative_kl
from lmppo.training.progress import ProgressDisplay
from lmppo.training.resume import checkpoint_trainer, load_trainer_checkpoint, resume_trainer


@dataclass
class ScoredRollout:
    """Phase 2 output: scores placed on response tokens."""

    token_scores: torch.Tensor  # (B, T) weighted sum of the sources' placed scores, normalised/clipped, then the
    #                             truncation penalty; all 0 on invalid rows
    raw_scores: torch.Tensor  # (B,) per-response total before truncation penalty / normalisation
    valid: torch.Tensor  # (B,) bool, False where a reward source gave bad output and on_bad_output = drop
    per_source: dict[str, torch.Tensor]  # name -> (B,) unweighted per-response totals


@dataclass
class TokenRewards:
    """Phase 3 output."""

    rewards: torch.Tensor  # (B, T) score placement minus beta * KL (+ bootstrap)
    kl: torch.Tensor  # (B, T) per-token KL estimate (0 at padding)
    train_mask: torch.Tensor  # (B, T) bool, tokens that get policy and value gradients


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


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
    on_save, ...).

    Construction from the config is the assembly step (`lmppo.training.assembly.build_components`); `components=` takes
    ready ones instead (then `config` is `components.config` and the other objects are not used). `resuming`:
    the output folder already holds this run (`PPOTrainer.resume`).
    """

    def __init__(
        self,
        config: Config,
        *,
        policy: Optional[nn.Module] = None,
        tokenizer: Any = None,
        prompts: Optional[Sequence] = None,
        reward_functions: Any = None,
        console: Any = None,
        value_model: Optional[nn.Module] = None,
        ref_model: Optional[nn.Module] = None,
        resuming: bool = False,
        components: Optional[Components] = None,
        callbacks: Optional[Sequence[Any]] = None,
    ):
        quiet_libraries()  # library noise off, as in the CLI (lmppo.quiet)
        if (
            components is None
        ):  # the assembly step (lmppo.training.assembly): models, data, rewards, optimizer from config
            components = build_components(
                config,
                policy=policy,
                tokenizer=tokenizer,
                prompts=prompts,
                reward_functions=reward_functions,
                value_model=value_model,
                ref_model=ref_model,
                console=console,
                resuming=resuming,
            )
        c = components
        self.config = cfg = c.config
        self.console = console
        self.accelerator, self.strategy, self.device = c.accelerator, c.strategy, c.accelerator.device
        self.precision, self.distorting = c.precision, c.distorting
        self.tokenizer, self.stop_ids = c.tokenizer, c.stop_ids
        self.actor, self.critic, self.reference = c.actor, c.critic, c.reference
        self.optimizer, self.scheduler, self.trainable_params = c.optimizer, c.scheduler, c.trainable_params
        self.prompt_set, self.holdout_set, self.stream = c.prompt_set, c.holdout_set, c.stream
        self.reward_sources, self.kl_controller = c.reward_sources, c.kl_controller
        self.sampling_engines: dict[str, SamplingEngine] = dict(c.sampling_engines)  # built on first use
        self.base_model, self.prompt_source = c.base_model, c.prompt_source  # as the model cards name them
        self.score_moments = RunningMoments()
        self.update_generator = torch.Generator().manual_seed(cfg.seed + 1)
        self.first_epoch_forward: Optional[PolicyOutput] = None  # see `_reuses_rollout_forward`
        self.iteration = 0  # completed iterations
        self.episode = 0  # episodes trained on
        self.nonfinite_in_a_row = 0
        self.train_seconds = 0.0
        self.frozen_fingerprint: Optional[str] = None  # of the weights training does not change (resume checks it)
        self.history: list[dict[str, float]] = []
        self.logger: Optional[MetricsLogger] = None
        self.progress = ProgressDisplay()
        self.callbacks = callback_list(callbacks)
        self.stop_requested = False  # set by `stop()` (a callback): the loop ends after the current iteration
        if self.accelerator.is_main_process:  # the run-folder lock (taken by the assembly) is held while this lives
            weakref.finalize(self, lock.release, cfg.output_dir)

    # ------------------------------------------------------------------ the loop
    def train(self) -> list[dict[str, float]]:
        """Run the remaining iterations; returns the metrics of every iteration."""
        cfg = self.config
        self._open_logger()
        self.callbacks.call("on_train_begin", self)
        started = time.perf_counter() - self.train_seconds
        try:
            while self.iteration < cfg.num_iterations and not self.stop_requested:
                timer, stats = PhaseTimer(), MetricsAccumulator()
                with timer("rollout"):
                    rollout = self.collect_rollout()  # 1. generate, logprobs, reference, values
                with timer("score"):
                    scored = self.score(rollout)  # 2. reward sources -> placed scores
                with timer("rewards"):
                    if self.kl_reacts_now:
                        self.adapt_kl_coef(rollout)  # beta answers this batch's own KL (kl.react: now)
                    rewards = self.token_rewards(rollout, scored)  # 3. scores - beta * KL, truncation policy
                with timer("advantages"):
                    advantages, returns = self.advantages(rollout, rewards)  # 4. GAE, whitening
                with timer("update"):
                    self.ppo_update(rollout, advantages, returns, rewards.train_mask, stats)  # 5. PPO epochs
                self.train_seconds = time.perf_counter() - started
                self.finish_iteration(rollout, scored, rewards, stats, timer)  # 6. log, adapt KL, sync ref
        finally:
            if self.logger is not None:
                self.logger.close()
                self.logger = None
        self.save_model(os.path.join(cfg.output_dir, "final"))
        self.callbacks.call("on_train_end", self, self.history)
        return self.history

    def stop(self) -> None:
        """End training after the current iteration (its checkpoint and the final model are written as usual)."""
        self.stop_requested = True

    # ------------------------------------------------------------------ 1. rollout
    @property
    def policy(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.actor).policy

    def collect_rollout(self) -> Rollout:
        cfg = self.config.rollout
        k, rank = cfg.num_samples_per_prompt, self.accelerator.process_index
        prompts = self.stream.next_batch(rank, self.accelerator.num_processes)  # this process's slice
        index = [i for i in prompts for _ in range(k)]  # each prompt k times, consecutive
        first_row = rank * len(index)  # rows of the global batch held by this process start here
        positions = list(range(first_row, first_row + len(index)))
        group_ids = torch.tensor([p // k for p in positions], device=self.device)
        prompt_ids, prompt_mask = left_pad([self.prompt_set.ids[i] for i in index], self.tokenizer.pad_token_id)
        prompt_ids, prompt_mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        seeds = [response_seed(self.config.seed, self.iteration, p) for p in positions]
        batch = PromptBatch(
            ids=prompt_ids, mask=prompt_mask, token_lists=[self.prompt_set.ids[i] for i in index], seeds=seeds
        )
        # sampling runs in the same precision as the logprob passes below (bf16 autocast: 2.7x faster
        # generation on SmolLM2 here, benchmarks/speed/sampler_speed.py)
        with self._autocast(), self.strategy.generation(self.actor):
            response_ids, response_mask, terminated, truncated = self.sampling_engine().sample(self.policy, batch)
        P = prompt_ids.shape[1]
        input_ids = torch.cat([prompt_ids, response_ids], 1)
        attention_mask = torch.cat([prompt_mask, response_mask], 1)
        chunk = cfg.forward_batch_size or input_ids.shape[0]
        reuse = self._reuses_rollout_forward(input_ids.shape[0], chunk)
        exact = self.config.kl.estimator == "exact"
        logprobs, ref_logprobs, values, entropies, ref_logits, exact_kls = [], [], [], [], [], []
        with self._autocast():
            for s in range(0, input_ids.shape[0], chunk):
                ids, att, resp = input_ids[s : s + chunk], attention_mask[s : s + chunk], response_ids[s : s + chunk]
                with torch.inference_mode():  # first: a LoRA reference adapter is swapped in place, which would
                    # invalidate a graph kept from the policy pass (`_reuses_rollout_forward`)
                    ref = self.reference.logits(self.policy, ids, att, P, cfg.temperature)
                    ref_logprobs.append(selective_log_softmax(ref, resp))
                out = self._old_policy_and_values(ids, att, P, keep_graph=reuse)
                with torch.inference_mode():
                    logprobs.append(selective_log_softmax(out.logits, resp))
                    if self.config.log.token_stats:
                        entropies.append(entropy_from_logits(out.logits))
                    if exact:
                        ref_logits.append(ref)
                        exact_kls.append(exact_kl(out.logits, ref, chunk_size=64))
                    values.append(out.values)
                del ref
        # clone out of inference mode: these tensors enter the loss as constants
        logprobs, ref_logprobs, all_values = (torch.cat(x).clone() for x in (logprobs, ref_logprobs, values))
        lengths = response_mask.sum(1)
        final_values = all_values.gather(1, lengths[:, None]).squeeze(1)  # V of the state after the last token
        zeros = torch.zeros_like(logprobs)
        responses_text = [
            self._completion_text(r[m], bool(t)) for r, m, t in zip(response_ids, response_mask, terminated)
        ]
        return Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            logprobs=torch.where(response_mask, logprobs, zeros),
            ref_logprobs=torch.where(response_mask, ref_logprobs, zeros),
            values=torch.where(response_mask, all_values[:, :-1], zeros),
            final_values=final_values,
            terminated=terminated,
            truncated=truncated,
            group_ids=group_ids,
            prompts_text=[self.prompt_set.texts[i] for i in index],
            responses_text=responses_text,
            entropy=torch.cat(entropies).clone() if entropies else None,
            ref_logits=torch.cat(ref_logits) if exact else None,  # (cat already leaves inference mode: no copy)
            exact_kl=torch.where(response_mask, torch.cat(exact_kls), zeros) if exact else None,
            prompt_columns=self.prompt_set.columns_of(index) if self.prompt_set.columns else None,
        )

    def sampling_engine(self, name: Optional[str] = None) -> SamplingEngine:
        """The engine of `rollout.backend` (or `name`), built from the registry (lmppo.sampling.engines) on first
        use."""
        name = name or self.config.rollout.backend
        if name not in self.sampling_engines:
            self.sampling_engines[name] = build_sampling_engine(
                name, self.config, self.stop_ids, self.tokenizer.pad_token_id, self.accelerator
            )
        return self.sampling_engines[name]

    def _reuses_rollout_forward(self, batch_size: int, forward_chunk: int) -> bool:
        """Whether the rollout's policy/value pass doubles as the first epoch's training forward.

        Before the first optimizer step the weights are those that made the rollout, so with one minibatch that is
        one micro-batch (and one rollout chunk) the first epoch would recompute exactly the old logprobs and values.
        Then the rollout pass runs with its autograd graph kept and the first backward uses it: one policy and one
        critic forward fewer per iteration, the same update (`ppo.reuse_rollout_forward`)."""
        p = self.config.ppo
        return (
            p.reuse_rollout_forward
            and self.strategy.reuses_rollout_forward
            and forward_chunk >= batch_size
            and self.config.minibatch_size // self.accelerator.num_processes == batch_size
            and p.micro_batch_size >= batch_size
        )

    def _old_policy_and_values(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, keep_graph: bool
    ) -> PolicyOutput:
        """Response logits and values under the rollout's weights: without a graph (inference mode), or with it,
        kept in `self.first_epoch_forward` for the first epoch's backward (see `_reuses_rollout_forward`)."""
        temperature = self.config.rollout.temperature
        if keep_graph:  # through the DDP wrappers: the backward of this pass must reduce gradients
            out = self.actor(input_ids, attention_mask, prompt_len, temperature)
            values = out.values if self.critic is None else self.critic(input_ids, attention_mask, prompt_len)
            self.first_epoch_forward = PolicyOutput(logits=out.logits, values=values)
            return PolicyOutput(logits=out.logits.detach(), values=values.detach())
        with torch.inference_mode():  # no-grad passes need no DDP wrapper
            out = self.accelerator.unwrap_model(self.actor)(input_ids, attention_mask, prompt_len, temperature)
            if self.critic is not None:
                out.values = self.accelerator.unwrap_model(self.critic)(input_ids, attention_mask, prompt_len)
            return out

    # ------------------------------------------------------------------ 2. score
    def score(self, rollout: Rollout) -> ScoredRollout:
        rc = self.config.reward
        prompt_ids = None
        if any(s.wants_token_ids for s in self.reward_sources):
            prompt_ids = [ids[mask].tolist() for ids, mask in zip(rollout.prompt_ids.cpu(), rollout.prompt_mask.cpu())]
        result = score_rollout(
            self.reward_sources,
            rollout.prompts_text,
            rollout.responses_text,
            rollout.response_ids.cpu(),
            rollout.response_mask.cpu(),
            self.tokenizer,
            rc.on_bad_output,
            terminated=rollout.terminated.cpu(),
            prompt_ids=prompt_ids,
            columns=rollout.prompt_columns,
        )
        token_scores = placed = result.token_scores.to(self.device, torch.float32)
        raw = token_scores.sum(1)
        mask, valid = rollout.response_mask, result.valid.to(self.device)
        if rc.normalize or rc.clip > 0:
            if rc.normalize:
                self.score_moments.update(raw[valid])
            mean, std = (self.score_moments.mean, self.score_moments.std) if rc.normalize else (0.0, 1.0)
            token_scores = normalize_scores(token_scores, mask, mean, std, rc.clip)
        if rc.truncation == "penalty":  # after normalisation: a cut response scores exactly `reward.penalty`
            token_scores = penalize_truncated(token_scores, mask, rollout.truncated, rc.penalty, rc.penalty_mode)
        if rc.truncation == "bootstrap":  # a cut response did not finish: only its per-token/span scores stay
            token_scores = unfinished_scores(
                token_scores,
                placed,
                mask,
                rollout.truncated,
                result.final_scores.to(self.device),
                self.score_moments.std if rc.normalize else 1.0,
            )
        token_scores = torch.where(valid[:, None], token_scores, torch.zeros_like(token_scores))
        return ScoredRollout(
            token_scores=token_scores,
            raw_scores=raw,
            valid=valid,
            per_source={k: v.to(self.device) for k, v in result.per_source.items()},
        )

    # ------------------------------------------------------------------ 3. per-token rewards
    def batch_kl(self, rollout: Rollout) -> torch.Tensor:
        """Per-token KL to the reference (`kl.estimator`), 0 past each response's end."""
        if self.config.kl.estimator == "exact":
            return rollout.exact_kl
        kl = KL_ESTIMATORS[self.config.kl.estimator](rollout.logprobs, rollout.ref_logprobs)
        return torch.where(rollout.response_mask, kl, torch.zeros_like(kl))

    @property
    def kl_reacts_now(self) -> bool:
        """`kl.react`: whether beta answers a batch's KL before that batch's rewards (else after its update)."""
        k = self.config.kl
        return k.react == "now" or (k.react == "auto" and k.controller == "pi")

    def mean_kl(self, kl: torch.Tensor, mask: torch.Tensor) -> float:
        """The batch's mean KL per response over all processes (`objective/kl`): what the KL controller reads."""
        return self.strategy.gather_mean(masked_sum(kl, mask, dim=1))

    def adapt_kl_coef(self, rollout: Rollout) -> None:
        """The KL controller answers this batch's KL (`kl.react: now`)."""
        self.kl_controller.update(self.mean_kl(self.batch_kl(rollout), rollout.response_mask))

    def token_rewards(self, rollout: Rollout, scored: ScoredRollout) -> TokenRewards:
        cfg = self.config
        mask = rollout.response_mask
        kl = self.batch_kl(rollout)
        beta = self.kl_controller.coef if cfg.kl.placement in ("reward", "both") else 0.0
        # exact: a token's reward carries the KL of the state it leads into; its own state's KL is a loss term
        penalized = next_state_kl(kl, mask) if cfg.kl.estimator == "exact" else kl
        rewards = kl_penalized_rewards(scored.token_scores, penalized, beta, mask)
        if cfg.reward.truncation == "bootstrap":
            rewards = bootstrap_truncated(rewards, mask, rollout.truncated, rollout.final_values, cfg.ppo.gamma)
        keep = scored.valid
        if cfg.reward.truncation == "drop":
            keep = keep & ~rollout.truncated
        return TokenRewards(rewards=rewards, kl=kl, train_mask=mask & keep[:, None])

    # ------------------------------------------------------------------ 4. advantages
    def advantages(self, rollout: Rollout, rewards: TokenRewards) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.config.ppo
        adv, returns = ADVANTAGE_ESTIMATORS[p.advantage_estimator](
            rewards.rewards,
            rollout.values,
            rollout.response_mask,
            gamma=p.gamma,
            lam=p.lam,
            group_ids=rollout.group_ids,
        )
        if p.whiten_advantages:
            adv = self.strategy.whiten(adv, rewards.train_mask)
        return adv, returns

    # ------------------------------------------------------------------ 5. PPO update
    def ppo_update(
        self,
        rollout: Rollout,
        advantages: torch.Tensor,
        returns: torch.Tensor,
        train_mask: torch.Tensor,
        stats: MetricsAccumulator,
    ) -> None:
        cfg = self.config
        W = self.accelerator.num_processes
        B, mb, micro = rollout.batch_size, cfg.minibatch_size // W, cfg.ppo.micro_batch_size
        for epoch, minibatch in self._minibatches(B, mb):
            # DDP averages gradients over processes, so each divides by (global token count / W):
            # the result is the token mean over the whole global minibatch
            num_tokens = self.accelerator.reduce(train_mask[minibatch].sum().float(), "sum").clamp(min=1) / W
            losses = []
            for m in range(0, mb, micro):
                idx = minibatch[m : m + micro]
                forward = None
                if epoch == 0 and self.first_epoch_forward is not None:  # the rollout's pass, graph kept
                    forward, self.first_epoch_forward = self.first_epoch_forward, None
                    forward = PolicyOutput(logits=forward.logits[idx], values=forward.values[idx])
                with self._sync_gradients(last=m + micro >= mb):
                    loss = self.micro_batch_loss(
                        rollout.select(idx), advantages[idx], returns[idx], train_mask[idx], num_tokens, stats, forward
                    )
                    self.accelerator.backward(loss, **self.strategy.backward_kwargs)
                losses.append(loss.detach())
            self.optimizer_step(self.accelerator.reduce(torch.stack(losses).sum(), "sum"), stats)
            if self._update_went_too_far(stats, len(losses)):
                break  # ppo.target_kl: the rest of this iteration's epochs are skipped
        self.update_lr = self.scheduler.get_last_lr()[0]  # the rate this iteration's updates used
        self.scheduler.step()

    def _minibatches(self, batch_size: int, minibatch_size: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(epoch, this process's minibatch indices): a fresh random order of the batch every epoch."""
        for epoch in range(self.config.ppo.num_epochs):
            order = torch.randperm(batch_size, generator=self.update_generator).to(self.device)
            for start in range(0, batch_size, minibatch_size):
                yield epoch, order[start : start + minibatch_size]

    def _update_went_too_far(self, stats: MetricsAccumulator, micro_batches: int) -> bool:
        """`ppo.target_kl`: after a minibatch's step, whether the approximate KL its forward measured (the policy
        after the steps before it, against the rollout policy) passed 1.5 x target_kl; every process decides alike."""
        target = self.config.ppo.target_kl
        if not target:
            return False
        stats.add("ppo/updates", 1.0)
        approx_kl = self.strategy.process_mean(stats.recent_mean("policy/approxkl_avg", micro_batches))
        stopped = approx_kl > 1.5 * target
        stats.add("ppo/early_stop", float(stopped))
        return stopped

    def micro_batch_loss(
        self,
        batch: Rollout,
        advantages: torch.Tensor,
        returns: torch.Tensor,
        mask: torch.Tensor,
        num_tokens: torch.Tensor,
        stats: MetricsAccumulator,
        forward: Optional[PolicyOutput] = None,
    ) -> torch.Tensor:
        """The micro-batch's share of the minibatch loss; `forward`: its policy/value pass if already run."""
        cfg = self.config
        batch, keep = _trim(batch)
        advantages, returns, mask = advantages[:, :keep], returns[:, :keep], mask[:, :keep]
        P = batch.prompt_ids.shape[1]
        if forward is None:
            with self._autocast():
                out = self.actor(batch.input_ids, batch.attention_mask, P, cfg.rollout.temperature)
                values = out.values if self.critic is None else self.critic(batch.input_ids, batch.attention_mask, P)
            forward = PolicyOutput(logits=out.logits, values=values)
        # (a reused pass covers the untrimmed response width: cut it to this micro-batch's)
        logits, values = forward.logits[:, :keep], forward.values[:, :keep]  # V(s_0) .. V(s_{keep-1})
        kl_estimator = None  # the KL term of the loss: `exact` with either placement, else with placement loss/both
        if cfg.kl.estimator == "exact" or cfg.kl.placement in ("loss", "both"):
            kl_estimator = "exact" if cfg.kl.estimator == "exact" else LOSS_KL_ESTIMATOR
        loss, objective_stats = ppo_objective(
            logits,
            values,
            batch.response_ids,
            batch.logprobs,
            batch.values,
            advantages,
            returns,
            mask,
            num_tokens,
            clip_range=cfg.ppo.clip_range,
            value_clip_range=cfg.ppo.value_clip_range,
            vf_coef=cfg.ppo.vf_coef,
            entropy_coef=cfg.ppo.entropy_coef,
            kl_coef=self.kl_controller.coef,
            kl_estimator=kl_estimator,
            ref_logprobs=batch.ref_logprobs,
            ref_logits=batch.ref_logits,
        )
        for name, value in objective_stats.items():
            stats.add(name, value)
        return loss

    def _sync_gradients(self, last: bool):
        """Gradient all-reduce only on the last micro-batch of a minibatch (the strategy decides how)."""
        return self.strategy.sync_gradients(last, self.actor, self.critic)

    def optimizer_step(self, loss: torch.Tensor, stats: MetricsAccumulator) -> None:
        max_norm = self.config.ppo.max_grad_norm or float("inf")
        grad_norm = self.accelerator.clip_grad_norm_(self.trainable_params, max_norm)
        grad_norm = torch.as_tensor(grad_norm)
        if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_in_a_row += 1
            stats.add("update/skipped_nonfinite", 1.0)
            if self.nonfinite_in_a_row >= self.config.ppo.max_nonfinite_updates:
                raise TrainingError(
                    f"{self.nonfinite_in_a_row} updates in a row had a non-finite loss or gradient "
                    f"(loss {loss.item()}, grad norm {grad_norm.item()}); stopping. Lower "
                    "ppo.learning_rate, check the reward scale, or use reward.clip."
                )
            return
        self.nonfinite_in_a_row = 0
        stats.add("update/skipped_nonfinite", 0.0)
        stats.add("policy/grad_norm", grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ 6. log, adapt, sync
    def finish_iteration(
        self,
        rollout: Rollout,
        scored: ScoredRollout,
        rewards: TokenRewards,
        stats: MetricsAccumulator,
        timer: PhaseTimer,
    ) -> None:
        cfg = self.config
        self.iteration += 1
        self.episode += cfg.rollout.batch_size  # global: every process's responses
        measured_kl = self.mean_kl(rewards.kl, rollout.response_mask)
        metrics = self.iteration_metrics(rollout, scored, rewards, stats, timer)
        if cfg.log.eval_every and self.iteration % cfg.log.eval_every == 0:
            metrics.update(self.evaluate_heldout())  # eval/*: the policy on the held-out prompts
        if not self.kl_reacts_now:
            self.kl_controller.update(measured_kl)
        if self.reference.after_iteration(self.iteration, self.policy):
            metrics["reference/updated"] = 1.0
        warn_negative_kl(measured_kl, cfg.kl.warn_below, rewards.kl, rollout.response_mask, rollout.responses_text)
        self.history.append(metrics)
        if self.logger is not None:  # the main process writes metrics, samples and the console
            self.logger.log(metrics, self.episode)
            self._print_progress(metrics)
            self.callbacks.call("on_log", self, dict(metrics))
        if (
            self.logger is not None
            and cfg.log.sample_every
            and cfg.log.num_samples
            and (self.iteration % cfg.log.sample_every == 0 or self.iteration == 1)
        ):
            self.logger.log_samples(
                self.sample_rows(rollout, scored, rewards), self.episode, f"samples at episode {self.episode}"
            )
        self.callbacks.call("on_iteration_end", self, metrics)
        # a callback may have called stop() on one process only (on_log runs on the main one): all agree
        self.stop_requested = bool(self.strategy.process_max(torch.tensor(float(self.stop_requested))))
        if (
            (cfg.checkpoint.every and self.iteration % cfg.checkpoint.every == 0)
            or self.iteration == cfg.num_iterations
            or self.stop_requested
        ):
            self.save_checkpoint()  # always after the last iteration, so a finished run can be extended

    def evaluate_heldout(self) -> dict[str, float]:
        """`eval/*`: one response per held-out prompt from the current policy, sampled on the evaluation's own
        random streams (the training draws are untouched), scored by every source, with its KL to the reference
        and its length (`lmppo.evaluation.heldout`); {} without held-out prompts and on processes other than the main
        one."""
        held, r = self.holdout_set, self.config.rollout
        if held is None or not len(held.ids):
            return {}
        policy = self.policy

        def reference_logits(input_ids, attention, P):
            return self.reference.logits(policy, input_ids, attention, P, r.temperature)

        with self.strategy.full_weights(self.actor):  # ZeRO-3: the full weights, as for the end-of-run summary
            if not self.accelerator.is_main_process:
                return {}
            result = sample_and_score(
                policy,
                held.ids,
                held.texts,
                tokenizer=self.tokenizer,
                sources=self.reward_sources,
                temperature=r.temperature,
                max_new_tokens=r.max_new_tokens,
                stop_ids=self.stop_ids,
                seed=self.config.seed,
                backend="hf" if r.backend == "hf" else "native",
                batch_size=self.config.no_grad_batch_size,
                reference_logits=reference_logits,
                autocast=self._autocast,
                columns=held.columns or None,
            )
        metrics = {f"eval/{k}": v for k, v in result.means().items() if v is not None}
        self.callbacks.call("on_evaluate", self, dict(metrics))
        return metrics

    def iteration_metrics(
        self,
        rollout: Rollout,
        scored: ScoredRollout,
        rewards: TokenRewards,
        stats: MetricsAccumulator,
        timer: PhaseTimer,
    ) -> dict[str, float]:
        """TRL's metric names with TRL's meaning, averaged over all processes, plus lmppo's own."""
        procs = self.strategy  # means, sums and maxima over all processes
        gather = procs.gather_mean
        mask = rollout.response_mask
        valid = scored.valid.float()
        kl_per_response = masked_sum(rewards.kl, mask, dim=1)
        beta = self.kl_controller.coef if self.config.kl.placement in ("reward", "both") else 0.0
        non_score = -beta * kl_per_response
        scores = scored.token_scores.sum(1)
        m: dict[str, float] = {
            "episode": self.episode,
            "iteration": self.iteration,
            "eps": self.episode / max(self.train_seconds, 1e-9),
            "lr": self.update_lr,
            "objective/kl": gather(kl_per_response),
            "objective/kl_coef": beta,
            "objective/entropy": gather(masked_sum(-rollout.logprobs, mask, dim=1)),
            "objective/non_score_reward": gather(non_score),
            "objective/scores": gather(scores),
            "objective/scores_raw": gather(scored.raw_scores),
            "objective/rlhf_reward": gather(scores + non_score),
            "val/num_eos_tokens": gather(rollout.terminated.float())
            * rollout.batch_size
            * self.accelerator.num_processes,
            "response/length_mean": gather(mask.sum(1).float()),
            "response/truncated_frac": gather(rollout.truncated.float()),
            "reward/num_invalid": procs.process_sum((1 - valid).sum()),
            f"truncation/{self.config.reward.truncation}_count": procs.process_sum(rollout.truncated.sum()),
            "objective/kl_token_min": -procs.process_max(-rewards.kl[mask].min() if mask.any() else torch.zeros(())),
        }
        for name, per_response in scored.per_source.items():
            m[f"reward/{name}"] = gather(per_response)
        for name in (
            "loss/policy_avg",
            "loss/value_avg",
            "policy/clipfrac_avg",
            "val/clipfrac_avg",
            "policy/approxkl_avg",
            "policy/entropy_avg",
            "val/ratio",
            "policy/grad_norm",
            "loss/kl_avg",
        ):
            if name in stats:
                m[name] = procs.process_mean(stats.mean(name))
        if "ppo/updates" in stats:  # ppo.target_kl: optimizer steps taken, and whether the brake stopped them
            m["ppo/updates"] = float(len(stats._values["ppo/updates"]))
            m["ppo/early_stop"] = max(v.item() for v in stats._values["ppo/early_stop"])
        if "val/ratio" in stats:
            m["val/ratio_var"] = procs.process_mean(stats.var("val/ratio"))
        if "update/skipped_nonfinite" in stats:
            m["update/skipped_nonfinite"] = stats.mean("update/skipped_nonfinite") * len(
                stats._values["update/skipped_nonfinite"]
            )
        total = sum(timer.seconds.values())
        for phase, sec in timer.seconds.items():
            m[f"time/{phase}"] = sec
        tokens = (rollout.attention_mask.sum()).item()
        m["tokens_per_s"] = tokens / max(total, 1e-9)
        if self.distorting:
            m["rollout/distorting_sampling"] = 1.0
        return m

    def sample_rows(self, rollout: Rollout, scored: ScoredRollout, rewards: TokenRewards) -> list[dict[str, Any]]:
        n = min(self.config.log.num_samples, rollout.batch_size)
        scores = scored.token_scores.sum(1)
        rows = []
        for i in range(n):
            row: dict[str, Any] = {
                "prompt": rollout.prompts_text[i],
                "response": rollout.responses_text[i],
                "score": float(scores[i]),
            }
            if self.config.log.token_stats:
                m = rollout.response_mask[i]
                toks = self.tokenizer.convert_ids_to_tokens(rollout.response_ids[i][m].tolist())
                kl = rewards.kl[i][m].tolist()
                row["kl per token"] = " ".join(f"{t}({k:+.2f})" for t, k in zip(toks, kl))
                if rollout.entropy is not None:
                    ent = rollout.entropy[i][m].tolist()
                    row["entropy per token"] = " ".join(f"{t}({e:.2f})" for t, e in zip(toks, ent))
                row["kl"] = float(sum(kl))
            rows.append(row)
        return rows

    # ------------------------------------------------------------------ saving
    def save_model(self, directory: str) -> None:
        """The trained policy (and value model) in Hugging Face format with safetensors, written atomically, each
        folder with its model card; a LoRA policy also merged into full weights (`model.lora.save_merged`)."""
        if self.accelerator.is_main_process:
            warn_unmerged(self.config.model, self.policy)
        with self.strategy.saving(self.actor):  # ZeRO-3: every process gathers the full weights for the save
            if self.accelerator.is_main_process:
                unwrap = self.accelerator.unwrap_model
                export_model(
                    directory,
                    self.policy,
                    self.tokenizer,
                    value_head=unwrap(self.actor).value_head,
                    value_model=unwrap(self.critic).model if self.critic is not None else None,
                    keep="the checkpoint of the last iteration is complete: free space and run "
                    f"`lmppo train --resume {self.config.output_dir}` to write it again",
                    merged=writes_merged(self.config.model, self.policy),
                    cards=self.model_card,
                    adapter_base=hub_repo_id(self.base_model) if self.base_model else None,
                )
                self.callbacks.call("on_save", self, directory)

    def model_card(
        self, folder: str, heldout: Optional[Sequence[tuple[str, str, str, str]]] = None, heldout_title: str = ""
    ) -> str:
        """The README.md text of `final/<folder>` (`lmppo.run.model_card`); `heldout`: the before/after rows."""
        return card_text(
            folder,
            self.config,
            redacted_config_dict(self.config),
            self.base_model,
            adapter=is_peft_model(self.policy),
            merged=writes_merged(self.config.model, self.policy) if folder != "value" else False,
            iterations=self.iteration,
            heldout=heldout,
            heldout_title=heldout_title,
            rewards=[(source.name, float(source.weight)) for source in self.reward_sources],
            prompts=self.prompt_source if self.prompt_source.startswith("passed") else "",
        )

    def rewrite_model_cards(
        self, directory: str, heldout: Sequence[tuple[str, str, str, str]], heldout_title: str
    ) -> None:
        """The cards of the folders in `directory` written again with the held-out before/after table."""
        for folder in card_folders(directory):
            write_text(
                os.path.join(directory, folder, "README.md"),
                self.model_card(folder, heldout, heldout_title),
                "the model card",
            )

    def save_checkpoint(self) -> Optional[str]:
        path = checkpoint_trainer(self)  # (sharded under DeepSpeed: `lmppo.distributed.strategy`)
        if self.accelerator.is_main_process:
            self.callbacks.call("on_save", self, path)
        return path

    # ------------------------------------------------------------------ helpers
    def _completion_text(self, ids: torch.Tensor, terminated: bool) -> str:
        ids = ids.tolist()
        return decode_completion(self.tokenizer, ids[:-1] if terminated else ids)

    def _lr_factor(self, step: int) -> float:
        return lr_factor(step, self.config.ppo, self.config.num_iterations)

    def _autocast(self):
        if self.config.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    @property
    def prompts_per_iteration(self) -> int:
        return prompts_per_iteration(self.config)

    @property
    def zero(self):
        """The DeepSpeed side of the strategy (`lmppo.distributed.zero.ZeroSupport`), None without DeepSpeed."""
        return self.strategy.zero

    def _open_logger(self) -> None:
        if self.logger is None and self.accelerator.is_main_process:
            cfg = self.config
            trackers = make_trackers(
                cfg.log.trackers,
                cfg.output_dir,
                redacted_config_dict(cfg),
                os.path.basename(os.path.abspath(cfg.output_dir)),
            )
            self.logger = MetricsLogger(cfg.output_dir, trackers, self.console, append=self.iteration > 0)

    def _print_progress(self, m: Optional[dict[str, float]]) -> None:
        """Progress after iteration `self.iteration` (metrics `m`; None: before the first one of this session)."""
        self.progress.show(
            self.console,
            self.config.log.progress,
            self.iteration,
            self.config.num_iterations,
            self.episode,
            self.train_seconds,
            m,
        )

    # ---- resume (docs/checkpoints.md: the format and what exact resume restores)
    @classmethod
    def resume(
        cls,
        output_dir: str,
        *,
        config: Optional[Config] = None,
        overrides: Optional[dict] = None,
        console: Any = None,
        **kwargs: Any,
    ) -> "PPOTrainer":
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
        output_dir are cut back to the checkpoint's iteration."""
        return load_trainer_checkpoint(self, path)


def _trim(batch: Rollout) -> tuple[Rollout, int]:
    """Drop prompt columns that are padding in every row and response columns past the longest response."""
    first_real = int(batch.prompt_mask.float().argmax(1).min().item()) if batch.prompt_mask.any() else 0
    keep = max(int(batch.response_mask.sum(1).max().item()), 1)
    return replace(
        batch,
        prompt_ids=batch.prompt_ids[:, first_real:],
        prompt_mask=batch.prompt_mask[:, first_real:],
        response_ids=batch.response_ids[:, :keep],
        response_mask=batch.response_mask[:, :keep],
        logprobs=batch.logprobs[:, :keep],
        ref_logprobs=batch.ref_logprobs[:, :keep],
        values=batch.values[:, :keep],
        ref_logits=None if batch.ref_logits is None else batch.ref_logits[:, :keep],
        exact_kl=None if batch.exact_kl is None else batch.exact_kl[:, :keep],
    ), keep
