"""DeepSpeed ZeRO-2 / ZeRO-3 through accelerate: what lmppo's trainer needs beyond DDP.

Design notes: docs/design.md, `lmppo.distributed.zero`."""

from __future__ import annotations

import contextlib
import copy
import json
import os
from typing import Any, Iterator, Optional

import torch
from torch import nn

from lmppo.errors import CheckpointError, ConfigError, LmppoError
from lmppo.models.files import load_whole
from lmppo.models.loading import (
    NEW_SCORE_HEAD,
    Actor,
    Critic,
    _load_kwargs,
    build_critic,
    hf_model,
    hidden_size,
    is_peft_model,
)
from lmppo.models.partition import is_partitioned

ZERO_PRESETS = ("zero2", "zero3")
ENGINE_TAG = "deepspeed"
"""The folder of a checkpoint that holds DeepSpeed's own files (its `tag`)."""


def deepspeed_requested(cfg) -> bool:
    """True when the config names a DeepSpeed configuration or the launcher turned DeepSpeed on."""
    return bool(cfg.deepspeed) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def requested_zero_stage(cfg) -> Optional[int]:
    """The ZeRO stage this run will use as far as the config and the launcher say before anything starts: 0 without
    DeepSpeed, None when only the started engine will know (a launcher config file that names no stage)."""
    if not deepspeed_requested(cfg):
        return 0
    if cfg.deepspeed:
        try:
            stage = deepspeed_config(cfg.deepspeed).get("zero_optimization", {}).get("stage", 0)
        except (OSError, ConfigError):
            return None
        return int(stage) if str(stage).isdigit() else None
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")
    return int(stage) if stage.isdigit() else None


def deepspeed_config(name: str) -> dict:
    """The DeepSpeed config for `config.deepspeed`: a preset (`zero2`, `zero3`) or a JSON file."""
    if name in ZERO_PRESETS:
        return {
            "zero_optimization": {"stage": int(name[-1])},
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
        }
    with open(name) as fh:
        try:
            return json.load(fh)
        except json.JSONDecodeError as err:
            raise ConfigError("deepspeed", name, f"is not valid JSON ({err})") from None


def accelerator_kwargs(cfg) -> dict:
    """Keyword arguments for `Accelerator(...)`.

    Without DeepSpeed: `cpu=` from `config.device`, as before. With DeepSpeed, `cpu=False` (accelerate's `cpu=True`
    path never starts DeepSpeed) and, where there is no CUDA GPU, process groups over gloo with DeepSpeed's CPU
    accelerator (accelerate knows no backend for a CPU-only DeepSpeed run and would start one process per
    launch, each alone)."""
    if not deepspeed_requested(cfg):
        return {"cpu": cfg.device == "cpu"}
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise ConfigError(
            "deepspeed",
            cfg.deepspeed or "(set by the launcher)",
            "needs the `deepspeed` package: pip install deepspeed",
        ) from None
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    if "LOCAL_RANK" not in os.environ:
        raise ConfigError(
            "deepspeed",
            cfg.deepspeed or "(set by the launcher)",
            "needs a distributed launcher: `torchrun --nproc_per_node N -m lmppo train ...` or "
            "`accelerate launch --config_file examples/deepspeed/zero3.yaml -m lmppo train ...`",
        )
    kwargs: dict[str, Any] = {"cpu": False}
    if cfg.deepspeed:
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=deepspeed_config(cfg.deepspeed))
    if not torch.cuda.is_available():  # (on a GPU machine, DeepSpeed on CPU also needs DS_ACCELERATOR=cpu)
        kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    return kwargs


class ActorWithCritic(nn.Module):
    """Actor and critic as one module, so that one DeepSpeed engine (and one optimizer) trains both. Calling it
    is calling the actor (`lmppo.models.loading.Actor.forward`); the trainer calls `.critic` directly (under ZeRO-3 its
    layers gather their own parameters, as every partitioned submodule does)."""

    def __init__(self, actor: nn.Module, critic: nn.Module):
        super().__init__()
        self.policy = actor.policy
        self.value_head = actor.value_head
        self.critic = critic

    def forward(self, *args, **kwargs):
        return Actor.forward(self, *args, **kwargs)


def prepare(accelerator, actor: nn.Module, critic: Optional[nn.Module], optimizer, zero: Optional["ZeroSupport"]):
    """(actor, critic, optimizer) after `accelerator.prepare`; under DeepSpeed actor and critic share one engine."""
    if zero is not None and critic is not None:
        engine, optimizer = accelerator.prepare(zero.before_prepare(ActorWithCritic(actor, critic)), optimizer)
        return engine, accelerator.unwrap_model(engine).critic, optimizer
    if zero is not None:
        actor, optimizer = accelerator.prepare(zero.before_prepare(actor), optimizer)
        return actor, None, optimizer
    if critic is not None:
        return accelerator.prepare(actor, critic, optimizer)
    actor, optimizer = accelerator.prepare(actor, optimizer)
    return actor, None, optimizer


class ZeroSupport:
    """The DeepSpeed side of one trainer (None in the trainer when DeepSpeed is off)."""

    def __init__(self, accelerator, cfg):
        from accelerate.utils import DistributedType

        if accelerator.distributed_type != DistributedType.DEEPSPEED:
            raise LmppoError(
                f"DeepSpeed was requested but accelerate started `{accelerator.distributed_type}`; "
                "launch with torchrun or accelerate launch (several processes)"
            )
        self.accelerator = accelerator
        self.plugin = accelerator.state.deepspeed_plugin
        self.config = cfg
        self.stage = int(self.plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0))
        self._engines: list = []  # inference engines (the ZeRO-3 reference): kept alive with their hooks
        self._configure()

    @classmethod
    def maybe(cls, accelerator, cfg) -> Optional["ZeroSupport"]:
        from accelerate.utils import DistributedType

        if accelerator.distributed_type == DistributedType.DEEPSPEED or deepspeed_requested(cfg):
            return cls(accelerator, cfg)
        return None

    # ------------------------------------------------------------------ configuration
    def _configure(self) -> None:
        cfg, W = self.config, self.accelerator.num_processes
        ds = self.plugin.deepspeed_config
        micro = cfg.ppo.micro_batch_size
        steps = max(cfg.minibatch_size // W // micro, 1)
        where = cfg.deepspeed or "(launcher config)"
        if str(ds.get("fp16", {}).get("enabled", False)).lower() == "true":
            raise ConfigError(
                "deepspeed",
                where,
                "enables fp16, whose loss scaling lmppo does not handle; use `precision: bf16` (autocast) instead",
            )
        for key in ("optimizer", "scheduler"):
            if key in ds:
                raise ConfigError(
                    "deepspeed",
                    where,
                    f"has a `{key}` section; lmppo brings its own (AdamW from "
                    "ppo.learning_rate / adam_eps / weight_decay, schedule from ppo.lr_schedule): "
                    "remove it from the DeepSpeed config",
                )
        ds["train_micro_batch_size_per_gpu"] = micro
        ds["gradient_accumulation_steps"] = steps
        ds["train_batch_size"] = micro * steps * W
        ds["gradient_clipping"] = float(cfg.ppo.max_grad_norm or 0.0)
        ds.setdefault("zero_optimization", {})
        if self.stage == 3:
            ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        ds["steps_per_print"] = float("inf")
        # accelerate checks its own gradient accumulation against DeepSpeed's
        self.accelerator.gradient_accumulation_steps = steps

    def _fill_hidden_size(self, hidden: int, config: Optional[dict] = None) -> None:
        """Fill the ZeRO bucket sizes left at `auto` from the policy's hidden size (as accelerate / TRL do)."""
        zero = (config if config is not None else self.plugin.deepspeed_config).setdefault("zero_optimization", {})
        for key, value in (
            ("reduce_bucket_size", hidden * hidden),
            ("stage3_prefetch_bucket_size", int(0.9 * hidden * hidden)),
            ("stage3_param_persistence_threshold", 10 * hidden),
        ):
            if zero.get(key) == "auto":
                zero[key] = value

    def before_prepare(self, module: nn.Module) -> nn.Module:
        self._fill_hidden_size(hidden_size(module.policy))
        return module

    # ------------------------------------------------------------------ models
    @contextlib.contextmanager
    def whole_models(self) -> Iterator[None]:
        """Inside the block, transformers loads models whole (no `zero.Init` partitioning under ZeRO-3)."""
        from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

        if not is_deepspeed_zero3_enabled():
            yield
            return
        unset_hf_deepspeed_config()
        try:
            yield
        finally:
            self.plugin.set_deepspeed_weakref()

    def models_built(self) -> None:
        """The trainable models and the reference exist: whatever loads from here on (reward models, encoders
        used by reward functions) loads whole, as an ordinary model."""
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()

    def build_critic(self, policy: nn.Module, policy_path: Optional[str], init_path: Optional[str], mc):
        """`lmppo.models.loading.build_critic`, also when ZeRO-3 has partitioned the policy at load."""
        if init_path is not None:
            return build_critic(policy, init_path, mc)  # loads (partitioned or not) like the policy did
        if not is_partitioned(policy):
            with self.whole_models():  # built from the policy's whole trunk weights
                return build_critic(policy, None, mc)
        if policy_path is None:
            raise LmppoError(
                "under ZeRO-3 the critic is built from the policy's folder, but the policy was passed "
                "as an object; set model.policy or value.init_from to a folder"
            )
        # the policy's folder as a sequence classifier: its trunk weights, a new `score` head, zeroed as
        # build_critic zeroes it (gathered, set on process 0, partitioned again on the way out)
        from transformers import AutoModelForSequenceClassification

        import deepspeed

        model = load_whole(
            AutoModelForSequenceClassification.from_pretrained,
            policy_path,
            "policy model (as the critic's start)",
            mc.strict,
            NEW_SCORE_HEAD,
            num_labels=1,
            dtype=torch.float32,
            **_load_kwargs(mc),
        )
        head = list(model.score.parameters())
        with deepspeed.zero.GatheredParameters(head, modifier_rank=0):
            if self.accelerator.process_index == 0:
                with torch.no_grad():
                    for p in head:
                        p.zero_()
        if model.config.pad_token_id is None:
            model.config.pad_token_id = hf_model(policy).config.pad_token_id
        model.eval()
        return Critic(model)

    def reference_model(self, policy: nn.Module, policy_path: Optional[str], mc) -> Optional[nn.Module]:
        """The reference's own weights when ZeRO-3 needs them built here (None: `ReferencePolicy` copies the
        policy, or, with LoRA, needs no copy)."""
        if self.stage != 3 or is_peft_model(policy):
            return None
        if is_partitioned(policy):
            if policy_path is None:
                raise LmppoError(
                    "under ZeRO-3 the policy object passed in is partitioned; the reference must be "
                    "loaded from model.policy, so pass the policy as a folder (model.policy)"
                )
            from transformers import AutoModelForCausalLM

            model = load_whole(
                AutoModelForCausalLM.from_pretrained,
                policy_path,
                "reference model",
                mc.strict,
                dtype=torch.float32,
                **_load_kwargs(mc),
            )
        else:
            with self.whole_models():
                model = copy.deepcopy(hf_model(policy))
        model.requires_grad_(False)
        model.eval()
        return self.inference_engine(model)

    def inference_engine(self, model: nn.Module) -> nn.Module:
        """A frozen model partitioned by ZeRO-3 for forward passes only (TRL's `prepare_deepspeed`); returns the
        module (its layers gather their shards), the engine is kept alive here."""
        import deepspeed

        config = copy.deepcopy(self.plugin.deepspeed_config)
        for key in ("optimizer", "scheduler"):
            config.pop(key, None)
        self._fill_hidden_size(hidden_size(model), config)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()
        self._engines.append(engine)
        return engine.module

    # ------------------------------------------------------------------ training
    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        """The engine accumulates gradients and steps only after the last micro-batch of a minibatch."""
        state = self.accelerator.gradient_state
        state._set_sync_gradients(last)
        try:
            yield
        finally:
            state._set_sync_gradients(True)

    backward_kwargs = {"scale_wrt_gas": False}  # the loss already is the token mean over the minibatch

    # ------------------------------------------------------------------ sampling and saving
    def gathered_for_generation(self, engine) -> contextlib.AbstractContextManager:
        """ZeRO-3: the policy's full weights gathered and DeepSpeed's hooks removed for the block (sampling), then
        partitioned again and the hooks put back; else nothing. As DeepSpeed's own `unwrap_model_for_generation`,
        but only the policy is gathered (not a critic that shares its engine)."""
        if self.stage != 3:
            return contextlib.nullcontext()
        return _unhooked(engine, self.accelerator.unwrap_model(engine).policy.parameters())

    @contextlib.contextmanager
    def full_weights(self, engine) -> Iterator[None]:
        """ZeRO-3: the policy and the reference gathered and unhooked for the block, so that each process can
        sample and score on its own (the end-of-run held-out summary); else nothing."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.gathered_for_generation(engine))
            if self.stage == 3:
                for ref in self._engines:
                    stack.enter_context(_unhooked(ref, ref.module.parameters()))
            yield

    def gathered(self, engine) -> contextlib.AbstractContextManager:
        """ZeRO-3: the full weights gathered in every process for the block (saving); else nothing."""
        if self.stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(engine.module.parameters()))

    # ------------------------------------------------------------------ checkpoints
    def save_engine(self, engine, folder: str) -> None:
        """Every process writes its shards of the model and optimizer state into `folder/deepspeed` (DeepSpeed's
        `save_checkpoint`; a collective: every process must call it)."""
        engine.save_checkpoint(folder, tag=ENGINE_TAG, save_latest=False)

    def load_engine(self, engine, folder: str) -> None:
        """Every process reads its shards back from `folder/deepspeed` (DeepSpeed's `load_checkpoint`)."""
        path, _ = engine.load_checkpoint(
            folder, tag=ENGINE_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise CheckpointError(f"checkpoint {folder}: DeepSpeed could not load its {ENGINE_TAG}/ folder")


@contextlib.contextmanager
def _unhooked(engine, params) -> Iterator[None]:
    """ZeRO-3: `params` gathered in full and the engine's gather/release hooks removed for the block, so that
    forward passes run locally (no collectives, any number of them); partitioned and hooked again afterwards."""
    import deepspeed

    offload = getattr(engine.optimizer, "parameter_offload", None) or engine.optimizer
    root = offload.module
    start_of_forward = root._forward_pre_hooks.get(offload.fwd_pre_hook.id)  # a collective check per forward
    with deepspeed.zero.GatheredParameters(list(params)):
        for hook in offload.forward_hooks + offload.backward_hooks + [offload.fwd_pre_hook]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            if start_of_forward is not None:
                offload.fwd_pre_hook = root.register_forward_pre_hook(start_of_forward)
            offload._register_deepspeed_module(root)
