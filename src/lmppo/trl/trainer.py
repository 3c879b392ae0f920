"""TRL 1.12's `PPOTrainer` (its constructor, `train`, `save_model`, `generate_completions`, `state.log_history`,
callbacks) on lmppo's own trainer, `lmppo.training.trainer.PPOTrainer`."""

from __future__ import annotations

import copy
import json
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence, TypedDict, Union

import torch
from torch import nn
from transformers import TrainerState

from lmppo.episodes.road import EpisodePrompts
from lmppo.errors import ConfigError
from lmppo.evaluation.tables import make_console
from lmppo.models.loading import hf_model
from lmppo.quiet import quiet_libraries
from lmppo.rewards import FunctionSource, ModelSource, SourceContext
from lmppo.run.config_file import write_run_config
from lmppo.run.layout import CONFIG, METRICS
from lmppo.sampling.engines import PromptBatch
from lmppo.sampling.hf import left_pad
from lmppo.sampling.native import response_seed
from lmppo.sampling.settings import Sampling
from lmppo.training.trainer import PPOTrainer as LmppoTrainer
from lmppo.trl.config import PPOConfig
from lmppo.trl.fields import DOCS, REFUSED_UNLESS_DEFAULT, TRL_LOG_KEYS
from lmppo.trl.inputs import (
    PromptDataset,
    check_arguments,
    internal_tokenizer,
    prompt_ids,
    set_trl_sizes,
    with_adapters,
)
from lmppo.trl.translate import (
    check_resume_folder_kept,
    ignored_fields,
    lmppo_config,
    output_folder,
    refuse,
    resume_folder,
    stop_token_name,
)

if TYPE_CHECKING:
    from peft import PeftConfig
    from transformers import PretrainedConfig, PreTrainedTokenizerBase, TrainerCallback

    from lmppo.training.batch import Rollout
    from lmppo.training.metrics import MetricsAccumulator, PhaseTimer
    from lmppo.training.resume import TrainerObjects
    from lmppo.training.scoring import ScoredRollout, TokenRewards


Callback = Union["TrainerCallback", type["TrainerCallback"]]
"""A transformers callback, or its class (the handler builds it)."""
CompletionRow = TypedDict("CompletionRow", {"query": str, "model response": str, "score": float})
"""A row of `generate_completions` (TRL's keys)."""


class MissingEosPenalty:
    """TRL's `missing_eos_penalty` without a stop token, a reward source added to the reward model's score:
    -penalty for each response that holds no eos token (the responses run to response_length; TRL 1.12 subtracts
    the penalty from the score of those without one)."""

    def __init__(self, eos_token_id: int | None, penalty: float):
        if eos_token_id is None:
            raise ConfigError("missing_eos_penalty", penalty, "needs a tokenizer with an eos token")
        self.eos_token_id, self.penalty = int(eos_token_id), penalty

    def __call__(self, completion_ids: list[list[int]]) -> list[float]:
        return [0.0 if self.eos_token_id in ids else -self.penalty for ids in completion_ids]


class PolicyAndValueWrapper(nn.Module):
    """What TRL's `trainer.model` is: the policy and the value model side by side (`.policy`, `.value_model`)."""

    config: PretrainedConfig  # the policy's (set by PPOTrainer)

    def __init__(self, policy: nn.Module, value_model: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_model = value_model


@dataclass
class OnlineTrainerState(TrainerState):
    """TRL's trainer state: TrainerState plus the episode counter."""

    episode: int = 0


class PPOTrainer:
    """TRL 1.12's `PPOTrainer(args, processing_class, model, ref_model, reward_model, train_dataset, value_model,
    data_collator=None, eval_dataset=None, optimizers=(None, None), callbacks=None, peft_config=None)`, trained by
    lmppo (`self.lmppo`, an `lmppo.training.trainer.PPOTrainer`, holds lmppo's own config, metrics and checkpoints)."""

    def __init__(
        self,
        args: PPOConfig,
        processing_class: PreTrainedTokenizerBase,
        model: nn.Module,
        ref_model: nn.Module | None,
        reward_model: nn.Module,
        train_dataset: PromptDataset,
        value_model: nn.Module,
        data_collator: object = None,
        eval_dataset: PromptDataset | None = None,
        optimizers: tuple[object, object] = (None, None),
        callbacks: list[Callback] | None = None,
        peft_config: PeftConfig | None = None,
    ) -> None:
        quiet_libraries()  # library noise off, as in the CLI (lmppo.quiet); before accelerate and DeepSpeed load
        from accelerate import PartialState
        from transformers import TrainerControl
        from transformers.integrations import get_reporting_integration_callbacks
        from transformers.trainer import DEFAULT_CALLBACKS, DEFAULT_PROGRESS_CALLBACK
        from transformers.trainer_callback import CallbackHandler, ExportableState, PrinterCallback

        check_arguments(args, model, ref_model, reward_model, value_model, train_dataset, data_collator, optimizers)
        check_resume_folder_kept(args, getattr(args, "_resume_folder_seen", False))
        self.args = args
        self.processing_class = processing_class
        self.reward_model = reward_model
        self.value_model = value_model
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.data_collator = None
        model = with_adapters(model, peft_config)
        self.policy_model = model
        self.ref_model = ref_model

        world = PartialState().num_processes
        self.counts = set_trl_sizes(args, world, len(train_dataset))  # as TRL computes them, written into args

        # -- lmppo's config and trainer, with the objects as given
        records = prompt_ids(train_dataset)
        tokenizer = internal_tokenizer(processing_class, model)
        self.config = lmppo_config(
            args,
            world_size=world,
            num_prompts=len(records),
            max_prompt_length=max(len(r) for r in records),
            stop_token=stop_token_name(args, processing_class),
            peft_config=peft_config,
        )
        ignored = ignored_fields(args)
        if ignored and PartialState().is_main_process:  # one warning, one line per group of fields
            warnings.warn(
                "lmppo.trl: PPOConfig fields set that change nothing (TRL 1.12's PPOTrainer ignores them too; see "
                f"{DOCS}):\n  " + "\n  ".join(ignored),
                UserWarning,
                stacklevel=2,
            )
        resume = resume_folder(args)
        device = "cpu" if args.use_cpu else str(PartialState().device)
        self.reward_source = ModelSource.from_model(
            reward_model,
            tokenizer,
            name="reward_model",
            ctx=SourceContext(device=device, batch_size=self.config.rollout.forward_batch_size),
        )
        rewards: list[FunctionSource | ModelSource] = [self.reward_source]
        if args.missing_eos_penalty is not None and self.config.rollout.stop_token == "none":
            penalty = MissingEosPenalty(processing_class.eos_token_id, float(args.missing_eos_penalty))
            rewards.append(FunctionSource.from_callable(penalty, name="missing_eos_penalty"))
        objects: TrainerObjects = dict(
            policy=model,
            tokenizer=tokenizer,
            prompts=list(records),
            reward_functions=rewards,
            value_model=value_model,
            ref_model=ref_model,
        )
        if resume:  # the same objects as the first run, then its latest complete checkpoint
            self.lmppo = _Engine.resume(resume, config=self.config, **objects)
        else:
            self.lmppo = _Engine(self.config, **objects)
        if self.lmppo.accelerator.is_main_process:
            rewrite_header(self.lmppo)
        self.lmppo.on_iteration = self._after_iteration
        if self.lmppo.config.precision == "bf16":
            self.reward_source.autocast_dtype = torch.bfloat16
        self.accelerator = self.lmppo.accelerator
        self.optimizer, self.lr_scheduler = self.lmppo.updater.optimizer, self.lmppo.updater.scheduler
        self.model = PolicyAndValueWrapper(self.lmppo.policy, value_model)
        self.model.config = self.lmppo.policy.config
        self.is_peft_model = hasattr(self.lmppo.policy, "peft_config")
        if args.num_sample_generations > 0:
            self.sample_generations_freq = max(1, self.counts.updates // args.num_sample_generations)

        # -- callbacks and state, as TRL sets them up
        callbacks_all = DEFAULT_CALLBACKS + get_reporting_integration_callbacks(args.report_to)
        self.callback_handler = CallbackHandler(
            callbacks_all + list(callbacks or []), self.model, processing_class, self.optimizer, self.lr_scheduler
        )
        self.add_callback(PrinterCallback if args.disable_tqdm else DEFAULT_PROGRESS_CALLBACK)
        self.control = TrainerControl()
        stateful = [cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)]
        self.state = OnlineTrainerState(
            is_local_process_zero=self.accelerator.is_local_main_process,
            is_world_process_zero=self.accelerator.is_main_process,
            stateful_callbacks=stateful,  # type: ignore[arg-type]  # typed list[TrainerCallback]; Trainer passes these
        )
        self._start_time = 0.0  # set by train()

    # ------------------------------------------------------------------ TRL's API
    def train(self) -> None:
        """Run every update (ceil(total_episodes / batch_size)); callbacks and `state.log_history` as in TRL."""
        args, state = self.args, self.state
        state.global_step = self.lmppo.iteration  # 0, or the updates of the run being resumed
        state.episode = self._start_episode = self.lmppo.episode
        state.log_history = self._logs_so_far()
        state.max_steps = self.counts.updates
        state.num_train_epochs = self.counts.total_episodes / len(self.train_dataset)  # type: ignore[assignment]  # TRL 1.12 stores the fraction
        for name in ("logging_steps", "eval_steps", "save_steps"):
            value = getattr(args, name)
            if value is not None:
                setattr(state, name, math.ceil(state.max_steps * value) if value < 1 else value)
        self.control = self.callback_handler.on_train_begin(args, state, self.control)
        self._start_time = time.time()
        self.lmppo.train()
        self.control = self.callback_handler.on_train_end(args, state, self.control)
        if self.control.should_save:  # a callback asked for it at the end; lmppo's final checkpoint is written
            self.control = self.callback_handler.on_save(args, state, self.control)

    def _after_iteration(self, metrics: dict[str, float]) -> None:
        """One TRL update done: log TRL's metrics, step-end callbacks, saves, sample generations."""
        args, state = self.args, self.state
        state.episode = self.lmppo.episode
        eps = (state.episode - self._start_episode) / max(time.time() - self._start_time, 1e-9)
        logs = _trl_logs({**metrics, "eps": eps})
        state.epoch = state.episode / len(self.train_dataset)
        state.global_step += 1
        self.log(logs)
        self.control = self.callback_handler.on_step_end(args, state, self.control)
        if self.control.should_save:  # lmppo wrote its checkpoint (checkpoint.every = save_steps)
            self.control = self.callback_handler.on_save(args, state, self.control)
        update = state.global_step
        if args.num_sample_generations > 0 and (update - 1) % self.sample_generations_freq == 0:
            self.generate_completions(sampling=True)

    def _logs_so_far(self) -> list[dict[str, float]]:
        """TRL's log history of the updates done before `train()`: none for a new run; a resumed run's, from
        OUTPUT_DIR/metrics.jsonl (cut back to its checkpoint when it was loaded)."""
        path = os.path.join(self.config.output_dir, METRICS)
        if not self.lmppo.iteration or not os.path.isfile(path):
            return []
        with open(path, encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        size = len(self.train_dataset)
        return [
            {**_trl_logs(m), "epoch": m["episode"] / size, "step": int(m["iteration"])}
            for m in rows
            if "iteration" in m and "episode" in m and int(m["iteration"]) <= self.lmppo.iteration
        ]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """As transformers' Trainer.log: add `epoch`, append {**logs, "step"} to the history, call on_log."""
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The policy in Hugging Face format (safetensors; a PEFT policy saves its adapter), the tokenizer, and the
        PPOConfig as training_args.json (TRL pickles it to training_args.bin)."""
        output_dir = output_dir or output_folder(self.args)
        if not self.accelerator.is_main_process:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.lmppo.policy.save_pretrained(output_dir, safe_serialization=True)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        with open(os.path.join(output_dir, "training_args.json"), "w", encoding="utf-8") as fh:
            fh.write(self.args.to_json_string())

    @torch.no_grad()
    def generate_completions(self, sampling: bool = False) -> list[CompletionRow] | None:
        """Near-greedy completions (temperature 0.01, as TRL) of the eval prompts in batches of
        per_device_eval_batch_size (the last partial batch dropped, as TRL), sampled on the run's road with this
        call's settings, scored by the reward model; prints the first 5 rows and returns every row ({"query",
        "model response", "score"}). `sampling`: the first batch only."""
        if self.eval_dataset is None:
            return None

        engine, tok = self.lmppo, self.lmppo.tokenizer
        prompts = [list(r) for r in prompt_ids(self.eval_dataset)]
        size = self.args.per_device_eval_batch_size
        near_greedy = Sampling(0.01 + 1e-7, self.config.rollout.max_new_tokens)  # this call's settings, not the run's
        rows: list[CompletionRow] = []
        for start in range(0, len(prompts) - size + 1, size):
            batch = prompts[start : start + size]
            ids, mask = left_pad(batch, tok.pad_token_id)
            seeds = [response_seed(self.config.seed + 1, engine.iteration, start + i) for i in range(len(batch))]
            asked = PromptBatch(ids.to(engine.device), mask.to(engine.device), batch, seeds)
            texts = [_decode(tok, p) for p in batch]
            episodes = engine.road().episodes(engine.policy, EpisodePrompts(asked, texts), near_greedy)
            resp, resp_mask = episodes.response_ids, episodes.response_mask
            responses = [r[m].tolist() for r, m in zip(resp.cpu(), resp_mask.cpu())]
            scores = self.reward_source([], [], token_ids=[p + r for p, r in zip(batch, responses)]) if batch else []
            for p, r, s in zip(batch, responses, scores):
                rows.append(
                    {
                        "query": _decode(tok, p, skip_special_tokens=True),
                        "model response": _decode(tok, r),
                        "score": float(s),
                    }
                )
            if sampling:
                break
        if self.accelerator.is_main_process and rows:
            _print_table(rows[:5])
            if "wandb" in (self.args.report_to or []):
                import wandb

                if wandb.run is not None:
                    wandb.log(
                        {"completions": wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])}
                    )
        return rows

    def push_to_hub(self, *args: object, **kwargs: object) -> None:
        raise refuse("push_to_hub", True, REFUSED_UNLESS_DEFAULT["push_to_hub"])

    # ------------------------------------------------------------------ callbacks and helpers (as transformers')
    def add_callback(self, callback: Callback) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: Callback) -> Optional[TrainerCallback]:
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: Callback) -> None:
        self.callback_handler.remove_callback(callback)

    def is_world_process_zero(self) -> bool:
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        return self.accelerator.is_local_main_process

    @property
    def lmppo_history(self) -> list[dict[str, float]]:
        """lmppo's own metrics of every iteration (a superset of TRL's, see docs/metrics.md)."""
        return self.lmppo.history


def _trl_logs(metrics: dict[str, float]) -> dict[str, float]:
    """TRL's logged metrics (`TRL_LOG_KEYS`, TRL's types) from lmppo's metrics of one update."""
    logs = {name: metrics.get(name, float("nan")) for name in TRL_LOG_KEYS}
    logs["eps"] = int(logs["eps"])
    logs["val/num_eos_tokens"] = int(round(logs["val/num_eos_tokens"]))
    logs["episode"] = int(logs["episode"])
    return logs


RESUME_WITH = (
    "the same script with --resume_from_checkpoint OUTPUT_DIR (PPOConfig.resume_from_checkpoint; a TRL drop-in run, "
    "whose models are Python objects: `lmppo train --resume` cannot rebuild it)"
)
"""How config.yaml's first line says to resume a drop-in run."""


def rewrite_header(engine: LmppoTrainer) -> None:
    """The run's config.yaml again, saying how to resume a drop-in run: its models and data are Python objects, so
    `lmppo train --resume` cannot rebuild it; the script can."""
    config = copy.deepcopy(engine.config)  # the file's copy: model.policy names the object passed, not a default
    name = str(getattr(hf_model(engine.policy), "name_or_path", "") or "")
    config.model.policy = name
    passed = "model.policy: the policy object passed to PPOTrainer(model=...)" + (
        f", loaded from {name}" if name else ", built in memory (no name_or_path)"
    )
    write_run_config(
        config,
        os.path.join(config.output_dir, CONFIG),
        [f"precision: {engine.precision.reason}", passed],
        resume_with=RESUME_WITH,
    )


class _Engine(LmppoTrainer):
    """lmppo's trainer, calling `on_iteration(metrics)` after each iteration's phase 6 (its checkpoint included, so
    TRL's `on_save` callbacks come after the files exist, as in TRL)."""

    on_iteration: Optional[Callable[[dict[str, float]], None]] = None

    def finish_iteration(
        self,
        batch: Rollout,
        scored: ScoredRollout,
        rewards: TokenRewards,
        stats: MetricsAccumulator,
        timer: PhaseTimer,
    ) -> None:
        super().finish_iteration(batch, scored, rewards, stats, timer)
        if self.on_iteration is not None:
            self.on_iteration(self.history[-1])


def _decode(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    text = tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str), "one sequence of ids decodes to one string"
    return text


def _print_table(rows: list[CompletionRow]) -> None:
    from rich.table import Table

    table = Table(show_lines=True)
    for column in rows[0]:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    make_console().print(table)
