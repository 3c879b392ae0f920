"""The configuration of `lmppo reward-model`: a root of its own beside `Config`, built from the same section
machinery (pydantic dataclasses, one docstring under every field, dotted overrides, YAML, `--help`), and spelling
every option the two commands share as `lmppo train` does (`output_dir`, `seed`, `precision`, `device`,
`overwrite`, `model.policy`, `model.lora.*`, `data.holdout`, `log.trackers`, `checkpoint.*`). Only the fields the
stage reads are here: an option it would ignore is not offered."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Annotated, Literal

import pydantic
from pydantic import NonNegativeFloat, PositiveFloat, PositiveInt

from lmppo.config.sections import _Section, section, set_root
from lmppo.config.types import Seed, registered
from lmppo.registry import TRACKERS


@section
class RewardModelLoraConfig(_Section):
    enabled: bool = True
    """Train LoRA adapters (merged into the saved model) and the score head; false: every weight."""
    r: PositiveInt = 16
    """LoRA rank."""
    alpha: PositiveFloat = 32.0
    """LoRA scaling numerator (the update is scaled by alpha / r)."""


@section
class RewardModelModelConfig(_Section):
    policy: str = "smollm2"
    """The model the reward model starts from, named as `lmppo train`'s `model.policy`: a local Hugging Face folder,
    a Hub id (`ORG/NAME`) or a built-in name (`smollm2`). A causal LM gets a new one-label score head; a sequence
    classifier keeps its own."""
    lora: RewardModelLoraConfig = field(default_factory=RewardModelLoraConfig)
    """LoRA / PEFT training."""


@section
class PreferenceDataConfig(_Section):
    pairs: str = "builtin:polarity-mixed"
    """Preference pairs in TRL's format (`chosen`, `rejected`, optional `prompt` and `margin`; text or chat): a
    .jsonl file, a datasets folder, a .parquet / .arrow file, or a built-in set (`builtin:polarity-mixed`,
    `builtin:polarity`, `builtin:polarity-continuations`). A `margin` column enters the loss as TRL's
    RewardTrainer puts it: -log sigmoid(r_chosen - r_rejected - margin)."""
    holdout: PositiveInt = 30
    """Pairs kept out of training (the last of a shuffle seeded with `seed`) for the held-out pair accuracy and
    margin; a pair sharing a response or a source text with a held-out one never trains."""
    max_length: PositiveInt = 128
    """Tokens per text at most (the start is cut: the end of an answer is always read)."""


@section
class BradleyTerryConfig(_Section):
    epochs: PositiveInt = 2
    """Passes over the training pairs."""
    learning_rate: Annotated[float, pydantic.Field(gt=0, lt=1)] = 2e-4
    """AdamW learning rate (constant)."""
    batch_size: PositiveInt = 8
    """Pairs per optimizer step (over all processes)."""
    center_rewards_coefficient: NonNegativeFloat = 0.0
    """TRL's `center_rewards_coefficient` (Eisenstein et al. 2023): adds this x the mean over the batch's pairs of
    (r_chosen + r_rejected)^2 to the loss, which pulls the scores toward 0 (a reward model whose scores centre on 0
    needs no normalisation in PPO). 0: off."""


@section
class RewardModelLogConfig(_Section):
    trackers: list[Annotated[str, registered(TRACKERS)]] = field(default_factory=lambda: ["tensorboard"])
    """Trackers besides `OUTPUT_DIR/metrics.jsonl` (always written), as `lmppo train`'s `log.trackers`:
    `tensorboard`, `wandb`, `trackio`, and through accelerate's tracker API `aim`, `comet_ml`, `mlflow`, `clearml`,
    `dvclive`, `swanlab` (each needs its package)."""


@section
class RewardModelCheckpointConfig(_Section):
    every: PositiveInt = 5
    """Optimizer steps between checkpoints (one is written at the end of each epoch too)."""
    keep_last: PositiveInt = 2
    """How many checkpoints to keep."""


@section
class RewardModelConfig(_Section):
    output_dir: str = "runs/reward-model"
    """The run folder: config.yaml, metrics.jsonl, trackers, checkpoints and the model, `final/reward-model` (the
    folder `reward.sources: [{kind: model, path: ...}]` takes). The default is what `lmppo train
    builtin:learned_reward` reads."""
    seed: Seed = 0
    """Seed of the held-out split, the data order and the new score head."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """As `lmppo train`: `auto` (bf16 autocast where this machine runs it faster: a CUDA GPU with bf16, a CPU with
    native bf16; fp32 elsewhere), `fp32`, or `bf16` (autocast of the scoring passes; weights, optimizer state and
    loss stay fp32). The choice and its reason are printed and stored in the run's config.yaml."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto` (what accelerate picks: CUDA where present), `cpu` or `cuda`. Several processes (torchrun, accelerate
    launch) train one model with DDP, each scoring its share of every batch."""
    overwrite: bool = False
    """Allow writing into an `output_dir` that holds another run (only that run's files are removed)."""
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    """The model to train."""
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    """Preference pairs."""
    training: BradleyTerryConfig = field(default_factory=BradleyTerryConfig)
    """The Bradley-Terry optimisation."""
    log: RewardModelLogConfig = field(default_factory=RewardModelLogConfig)
    """Trackers."""
    checkpoint: RewardModelCheckpointConfig = field(default_factory=RewardModelCheckpointConfig)
    """Checkpoints."""

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


set_root(RewardModelConfig)
