"""The assembly step: everything a `PPOTrainer` works with, built from a `Config` (and the objects the Python API
passes in place of what the config would load).

`build_components(config, policy=..., tokenizer=..., prompts=..., reward_functions=...)` validates the config,
checks the sampling engine, starts accelerate and the distribution strategy, seeds, resolves the precision,
prepares the output folder, loads the tokenizer, the policy, the value head or critic, the reference, the prompts
(with the held-out split), the reward sources, and builds the optimizer, the LR schedule and the KL controller.
The order is the order of the random draws a seeded run makes; keep it. The result is a `Components`; the
trainer takes one (`PPOTrainer(config, components=...)`) or builds one with this function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

from lmppo.config import Config, RewardSourceConfig, default_sources
from lmppo.config.sampling_settings import check_generation_kwargs
from lmppo.core.kl_control import KLController, make_kl_controller
from lmppo.data.prompts import PromptSet, PromptStream, run_prompt_records, split_holdout, tokenize_prompts
from lmppo.distributed.strategy import Strategy, make_strategy
from lmppo.distributed.zero import accelerator_kwargs
from lmppo.environments.factories import Factories, RunEnvironment, Tool, load_run_environment, name_python_objects
from lmppo.errors import ConfigError
from lmppo.models.attention import use_cpu_attention
from lmppo.models.cpu_memory import keep_freed_memory
from lmppo.models.loading import (
    WEIGHT_DTYPES,
    Actor,
    Critic,
    ValueHead,
    check_vocab_fits,
    enable_gradient_checkpointing,
    fetch_hub_models,
    hf_model,
    hidden_size,
    load_policy,
    load_tokenizer,
    prepare_policy,
    resolve_model_path,
)
from lmppo.models.optim import lr_factor, make_adamw
from lmppo.models.precision import PrecisionChoice, choose_precision
from lmppo.models.reference import ReferencePolicy
from lmppo.rewards import RewardSource, build_reward_sources, check_source_arguments, run_source_context
from lmppo.rewards.http_url import check_reward_urls
from lmppo.run.folder import prepare_output_dir
from lmppo.sampling.engines import SamplingEngine
from lmppo.sampling.hf import warn_distorting_once
from lmppo.sampling.stop import stop_token_ids
from lmppo.training.inputs import input_fingerprints
from lmppo.training.preflight import check_machine, check_tools

if TYPE_CHECKING:
    from rich.console import Console
    from transformers import PreTrainedTokenizerBase


@dataclass
class Components:
    """What the loop works with. Built by `build_components`, or by hand for the Python API."""

    config: Config  # validated; `precision` resolved
    accelerator: Accelerator
    strategy: Strategy  # single process / DDP / DeepSpeed ZeRO (lmppo.distributed.strategy)
    precision: PrecisionChoice  # the chosen precision and why
    tokenizer: PreTrainedTokenizerBase  # left padding, a pad token
    stop_ids: torch.Tensor  # (S,) token ids that end a response
    actor: nn.Module  # lmppo.models.loading.Actor (policy + shared value head), wrapped by the strategy
    critic: Optional[nn.Module]  # lmppo.models.loading.Critic (value.mode critic), wrapped; else None
    reference: ReferencePolicy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    trainable_params: list  # what the gradient norm is clipped over
    prompt_set: PromptSet  # training prompts
    holdout_set: PromptSet  # held-out prompts (data.holdout)
    stream: PromptStream  # which prompts each iteration takes
    reward_sources: list[RewardSource]
    kl_controller: KLController
    distorting: list[str] = field(default_factory=list)  # generation settings that bend the distribution (opted in)
    sampling_engines: dict[str, SamplingEngine] = field(default_factory=dict)  # ready engines by backend name
    #                                                    (others are built from the registry on first use)
    base_model: str = ""  # the policy's starting model as named in model cards: model.policy, or the passed object's
    #                       name_or_path (empty: an object built in memory)
    prompt_source: str = ""  # where the prompts came from, as named in model cards (data.prompts, or passed in)
    input_fingerprints: dict[str, str] = field(default_factory=dict)  # `lmppo.training.inputs`, resume checks them
    environment: Optional[RunEnvironment] = None  # environment.path or environment_factory=, loaded; None: none


def build_components(
    config: Config,
    *,
    policy: Optional[nn.Module] = None,
    tokenizer: Optional[PreTrainedTokenizerBase] = None,
    prompts: Optional[Sequence] = None,
    reward_functions: dict[str, Callable] | Sequence[Callable] | None = None,
    value_model: Optional[nn.Module] = None,
    ref_model: Optional[nn.Module] = None,
    console: Optional[Console] = None,
    resuming: bool = False,
    environment_factory: Optional[Factories] = None,
    tools: Sequence[Tool] = (),
) -> Components:
    """Everything the trainer needs, from `config`; objects passed in replace what the config would load (see
    `PPOTrainer`). `resuming`: the output folder holds this run already (`PPOTrainer.resume`). The steps in the
    order of the random draws a seeded run makes: checks before anything loads, the run's start (processes, seed,
    precision, folder), the models, the prompts, the reward sources, the optimisation."""
    if reward_functions is not None and not _has_user_sources(config):
        config.reward.sources = []
    name_python_objects(config.environment, environment_factory, tools)  # `python:...` in the config
    cfg = _validate_with_api_objects(config, reward_functions, prompts)
    check_reward_urls(cfg.reward)  # an HTTP source's scheme, host and port: one line, before anything loads
    records = run_prompt_records(cfg, prompts)  # a bad prompt file (FIFO, ragged CSV): before any model loads
    distorting = check_generation_kwargs(cfg.rollout.generation_kwargs, cfg.rollout.allow_distorting_sampling)
    check_machine(cfg)  # device, sampling engine, attention kernel, trackers: before the run folder or any model
    environment = load_run_environment(cfg.environment, environment_factory, tools)  # one line for a bad class
    if environment is not None:
        environment.check_rows(records.columns, records.where)  # a dict of factories: each row's `environment`
        check_tools(environment.tools)  # a docstring and type hints: one line, not transformers' traceback later
    # Hub ids downloaded (or one error naming the field) before the output folder is made or any model loads
    fetch_hub_models(cfg, policy_given=policy is not None and tokenizer is not None)
    run = start_run(cfg, console, resuming, value_model=value_model, ref_model=ref_model)
    models = load_models(cfg, run, policy=policy, tokenizer=tokenizer, value_model=value_model, ref_model=ref_model)
    all_prompts = tokenize_prompts(records, models.tokenizer, cfg.data)
    prompt_set, holdout_set = split_holdout(all_prompts, cfg.data.holdout, cfg.data.holdout_seed_for(cfg.seed))
    check_process_split(cfg, run.accelerator.num_processes)
    reward_sources = build_run_reward_sources(cfg, reward_functions, run.accelerator.device)
    _check_token_input(reward_sources, models.tokenizer)
    check_source_arguments(reward_sources, sorted({k for row in all_prompts.columns for k in row}))
    optimisation = build_optimisation(cfg, run, models)
    warn_distorting_once(distorting)
    return Components(
        config=cfg,
        accelerator=run.accelerator,
        strategy=run.strategy,
        precision=run.precision,
        tokenizer=models.tokenizer,
        stop_ids=models.stop_ids,
        actor=optimisation.actor,
        critic=optimisation.critic,
        reference=models.reference,
        optimizer=optimisation.optimizer,
        scheduler=optimisation.scheduler,
        trainable_params=optimisation.params,
        prompt_set=prompt_set,
        holdout_set=holdout_set,
        stream=PromptStream(
            len(prompt_set.ids), prompts_per_iteration(cfg), cfg.seed, cfg.data.shuffle, cfg.data.retire_settled_after
        ),
        reward_sources=reward_sources,
        kl_controller=make_kl_controller(cfg.kl, cfg.rollout.batch_size),
        distorting=distorting,
        base_model=cfg.model.policy if policy is None else str(getattr(hf_model(policy), "name_or_path", "") or ""),
        prompt_source=cfg.data.prompts if prompts is None else "passed to PPOTrainer(prompts=...)",
        input_fingerprints={
            name: value
            for name, value in input_fingerprints(cfg, records).items()
            if policy is None or name not in ("model.policy", "model.tokenizer")  # a passed object has no folder
        },
        environment=environment,
    )


@dataclass
class RunStart:
    """The run's processes, its precision and its folder, ready before any model loads (`start_run`)."""

    accelerator: Accelerator
    strategy: Strategy
    precision: PrecisionChoice


def start_run(
    cfg: Config,
    console: Optional[Console],
    resuming: bool,
    *,
    value_model: Optional[nn.Module],
    ref_model: Optional[nn.Module],
) -> RunStart:
    """accelerate and the distribution strategy, the seed, the precision (`auto` resolved into `cfg`), and the
    output folder with its config.yaml (a folder holding another run refused unless `overwrite: true`)."""
    accelerator = Accelerator(**accelerator_kwargs(cfg))
    strategy = make_strategy(accelerator, cfg)  # DeepSpeed ZeRO (lmppo.distributed.zero), else DDP / one process
    _check_model_objects(cfg, value_model, ref_model, strategy.zero is not None)
    set_seed(cfg.seed)
    # `auto` becomes what this machine runs faster; the run's config.yaml keeps the resolved value (and a resume
    # computes in the precision the run started with)
    precision = choose_precision(cfg.precision, accelerator.device.type)
    cfg.precision = precision.precision
    if console is not None and accelerator.is_main_process:
        console.print(f"precision {precision.precision}: {precision.reason}", highlight=False, soft_wrap=True)
    prepare_output_dir(cfg, accelerator.is_main_process, resuming, comments=[f"precision: {precision.reason}"])
    return RunStart(accelerator, strategy, precision)


@dataclass
class Models:
    """The run's models on its device (`load_models`); the critic and the reference's copy are not yet wrapped."""

    tokenizer: PreTrainedTokenizerBase  # left padding, a pad token
    policy: nn.Module
    stop_ids: torch.Tensor  # (S,) token ids that end a response
    value_head: Optional[ValueHead]  # value.mode shared
    critic: Optional[Critic]  # value.mode critic, or the value_model passed in
    reference: ReferencePolicy


def load_models(
    cfg: Config,
    run: RunStart,
    *,
    policy: Optional[nn.Module],
    tokenizer: Optional[PreTrainedTokenizerBase],
    value_model: Optional[nn.Module],
    ref_model: Optional[nn.Module],
) -> Models:
    """The tokenizer, the policy, the value head or critic and the reference: from the config, or the objects
    passed in (used as given); each checked against the tokenizer's vocabulary, attention chosen for each."""
    device, strategy = run.accelerator.device, run.strategy
    path = (
        resolve_model_path(cfg.model.policy, "model.policy", cfg.model.allow_pickle)
        if policy is None or tokenizer is None
        else None
    )
    tokenizer = _tokenizer(cfg, tokenizer, path)
    if policy is None:
        assert path is not None  # resolved whenever the policy is not passed
        policy = load_policy(cfg.model, path, WEIGHT_DTYPES[cfg.model.dtype])
    else:
        policy = prepare_policy(policy, cfg.model)
    _check_context_length(cfg, policy)
    check_vocab_fits(tokenizer, policy, "model.tokenizer" if cfg.model.tokenizer else "model.policy")
    stop_ids = stop_token_ids(cfg.rollout.stop_token, tokenizer, device)
    value_head = ValueHead(hidden_size(policy)) if cfg.value.mode == "shared" else None
    critic = _critic(cfg, strategy, policy, path, value_model, tokenizer)
    reference = ReferencePolicy(
        policy,
        cfg.reference.mode,
        cfg.reference.every,
        cfg.reference.ema_alpha,
        model=ref_model if ref_model is not None else strategy.reference_model(policy, path, cfg.model),
    )
    if reference.model is not None:
        reference.model.to(device)
    if device.type == "cpu":  # freed memory reused, not faulted in again every iteration (lmppo.models.cpu_memory)
        keep_freed_memory()
    _choose_attention(cfg, device, [hf_model(policy), critic.model if critic is not None else None, reference.model])
    strategy.models_built()  # (DeepSpeed: reward models load whole, never partitioned)
    return Models(tokenizer, policy, stop_ids, value_head, critic, reference)


def _tokenizer(
    cfg: Config, tokenizer: Optional[PreTrainedTokenizerBase], policy_path: Optional[str]
) -> PreTrainedTokenizerBase:
    """The tokenizer passed in, else `model.tokenizer`'s (default: the policy's), set to pad on the left."""
    if tokenizer is None:
        path = (
            resolve_model_path(cfg.model.tokenizer, "model.tokenizer", weights=False)
            if cfg.model.tokenizer
            else policy_path
        )
        assert path is not None  # the policy's path is resolved whenever the tokenizer is not passed
        tokenizer = load_tokenizer(path, cfg.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _critic(
    cfg: Config,
    strategy: Strategy,
    policy: nn.Module,
    policy_path: Optional[str],
    value_model: Optional[nn.Module],
    tokenizer: PreTrainedTokenizerBase,
) -> Optional[Critic]:
    """The value model passed in (its trunk and `score` head, as given), a critic built by `value.mode critic`, or
    None (a shared value head); it reads the policy's token ids."""
    if value_model is not None:
        critic = Critic(value_model.eval())
    elif cfg.value.mode == "critic":
        critic = strategy.build_critic(policy, policy_path, critic_init_path(cfg), cfg.model)
    else:
        return None
    check_vocab_fits(tokenizer, critic.model, "value.init_from" if value_model is None else "value_model", "critic")
    return critic


def build_run_reward_sources(
    cfg: Config, reward_functions: dict[str, Callable] | Sequence[Callable] | None, device: torch.device
) -> list[RewardSource]:
    """The config's reward sources and the functions passed in, on the run's device, in its precision."""
    return build_reward_sources(
        cfg.reward,
        reward_functions,
        ctx=run_source_context(cfg, device, cfg.precision),  # cfg.precision: chosen above
    )


@dataclass
class Optimisation:
    """What trains (`build_optimisation`): the actor and critic wrapped by the strategy, and their optimizer."""

    actor: nn.Module  # lmppo.models.loading.Actor (policy + shared value head), wrapped
    critic: Optional[nn.Module]  # wrapped Critic, or None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    params: list[nn.Parameter]  # every trainable parameter: what the gradient norm is clipped over


def build_optimisation(cfg: Config, run: RunStart, models: Models) -> Optimisation:
    """The actor (policy + value head), AdamW over it and the critic with the LR schedule, all wrapped by the
    strategy; gradient checkpointing switched on after the wrapping (which sets eval mode)."""
    actor = Actor(models.policy, models.value_head)
    params = [p for p in actor.parameters() if p.requires_grad]
    if models.critic is not None:
        params += [p for p in models.critic.parameters() if p.requires_grad]
    optimizer, scheduler = _optimizer_and_schedule(cfg, params)
    actor, critic, optimizer = run.strategy.prepare(actor, models.critic, optimizer)
    if cfg.model.gradient_checkpointing:  # after every .eval() (DeepSpeed's prepare has some)
        enable_gradient_checkpointing(run.accelerator.unwrap_model(actor).policy)
        if critic is not None:
            enable_gradient_checkpointing(run.accelerator.unwrap_model(critic).model)
    return Optimisation(actor, critic, optimizer, scheduler, params)


def _choose_attention(cfg: Config, device: torch.device, models: Sequence[Optional[nn.Module]]) -> None:
    """The user's attention kernel for every model; with `auto` on a CPU, eager attention for short bf16 passes
    (`lmppo.models.attention`)."""
    for model in models:
        if model is None:
            continue
        if cfg.model.attn_implementation != "auto":
            hf_model(model).set_attn_implementation(cfg.model.attn_implementation)
        elif device.type == "cpu":
            use_cpu_attention(model)


def _optimizer_and_schedule(
    cfg: Config, params: list[nn.Parameter]
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `params` and the learning-rate schedule of `ppo` over the run's iterations."""
    optimizer = make_adamw(params, cfg.ppo.learning_rate, cfg.ppo.adam_eps, cfg.ppo.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg.ppo, cfg.num_iterations))
    return optimizer, scheduler


def prompts_per_iteration(cfg: Config) -> int:
    return cfg.rollout.batch_size // cfg.rollout.num_samples_per_prompt


def check_process_split(cfg: Config, W: int) -> None:
    """Every process takes an equal share of the prompts and of each minibatch."""
    if prompts_per_iteration(cfg) % W:
        raise ConfigError(
            "rollout.batch_size",
            cfg.rollout.batch_size,
            f"with {W} processes, the prompts per iteration ({prompts_per_iteration(cfg)}) must "
            f"divide evenly among them",
        )
    if (cfg.minibatch_size // W) % cfg.ppo.micro_batch_size or cfg.minibatch_size % W:
        raise ConfigError(
            "ppo.micro_batch_size",
            cfg.ppo.micro_batch_size,
            f"must divide each process's share of a minibatch ({cfg.minibatch_size} / {W} processes)",
        )


def critic_init_path(cfg: Config) -> Optional[str]:
    """The folder the critic starts from (`value.init_from`); None: the policy's own trunk."""
    init = cfg.value.init_from
    model_sources = [s for s in cfg.reward.sources if s.kind == "model"]
    if init == "policy" or (init == "auto" and not model_sources):
        return None
    if init in ("auto", "reward_model"):
        index = cfg.reward.sources.index(model_sources[0])
        return resolve_model_path(model_sources[0].path, f"reward.sources[{index}].path", cfg.model.allow_pickle)
    return resolve_model_path(init, "value.init_from", cfg.model.allow_pickle)


def _check_context_length(cfg: Config, policy: nn.Module) -> None:
    """ConfigError when the longest prompt plus the longest response does not fit the model's positions."""
    model_cfg = hf_model(policy).config
    positions = getattr(model_cfg, "max_position_embeddings", None) or getattr(model_cfg, "n_positions", None)
    need = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if isinstance(positions, int) and need > positions:
        raise ConfigError(
            "data.max_prompt_length",
            cfg.data.max_prompt_length,
            f"+ rollout.max_new_tokens ({cfg.rollout.max_new_tokens}) = {need} tokens is more than the "
            f"policy model can attend to (max_position_embeddings = {positions}); lower one of them",
        )


def _check_token_input(sources, tokenizer) -> None:
    """ConfigError when a reward model reads the policy's token ids (`input: tokens`) but has another tokenizer."""
    for i, source in enumerate(sources):
        own = getattr(source, "tokenizer", None)
        if source.wants_token_ids and own is not None and own.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(
                f"reward.sources[{i}].input",
                "tokens",
                f"reward model `{source.name}` has its own tokenizer ({len(own)} tokens), not the "
                f"policy's ({len(tokenizer)} tokens): it must read text (`input: text`)",
            )


def _check_model_objects(
    cfg: Config, value_model: Optional[nn.Module], ref_model: Optional[nn.Module], zero: bool
) -> None:
    """ConfigError when a value_model / ref_model object passed in does not fit the config."""
    if value_model is not None and cfg.value.mode != "critic":
        raise ConfigError(
            "value.mode", cfg.value.mode, "a value_model object is a separate critic: set value.mode `critic`"
        )
    if (value_model is not None or ref_model is not None) and zero:
        raise ConfigError(
            "deepspeed",
            cfg.deepspeed or "(from the launcher)",
            "value_model / ref_model objects are "
            "not partitioned by lmppo's DeepSpeed support; give the models as folders",
        )
    if ref_model is not None and cfg.reference.mode != "frozen":
        raise ConfigError(
            "reference.mode",
            cfg.reference.mode,
            "a ref_model object is a frozen reference; use reference.mode `frozen`",
        )


def _has_user_sources(config: Config) -> bool:
    return config.reward.sources != default_sources()


def _validate_with_api_objects(config: Config, reward_functions: object, prompts: object) -> Config:
    """validate(), allowing what objects passed through the API replace (reward functions, prompts)."""
    if reward_functions is not None and not config.reward.sources:
        placeholder = RewardSourceConfig(kind="function", path="api:callable")
        config.reward.sources = [placeholder]
        try:
            config.validate() if prompts is None else _validate_without_prompts(config)
        finally:
            config.reward.sources = []
        return config
    return config.validate() if prompts is None else _validate_without_prompts(config)


def _validate_without_prompts(config: Config) -> Config:
    saved = config.data.prompts
    config.data.prompts = "builtin:api"
    try:
        config.validate()
    finally:
        config.data.prompts = saved
    return config
