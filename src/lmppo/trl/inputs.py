"""What TRL's `PPOTrainer(...)` is given, checked and prepared for lmppo: the constructor's arguments refused in
one line each (`check_arguments`), peft's adapters (`with_adapters`), the sizes TRL derives into its config
(`set_trl_sizes`), the prompts' token ids (`prompt_ids`) and the tokenizer lmppo pads with (`internal_tokenizer`)."""

from __future__ import annotations

import copy
import json
import math
from typing import TYPE_CHECKING, Iterator, NamedTuple, Protocol, Sequence

from tokenizers import Tokenizer
from torch import nn
from transformers import TrainingArguments

from lmppo.config import DataConfig
from lmppo.data.hf_datasets import is_hf_dataset
from lmppo.data.prompts import load_prompt_records
from lmppo.errors import ConfigError, LmppoError
from lmppo.models.loading import hf_model
from lmppo.models.parts import parameter
from lmppo.trl.fields import DOCS

if TYPE_CHECKING:
    from peft import PeftConfig
    from transformers import PreTrainedTokenizerBase

    from lmppo.trl.config import PPOConfig


class PromptDataset(Protocol):
    """A TRL dataset of prompts: a `datasets.Dataset` with an `input_ids` column, or any sized iterable of rows
    {"input_ids": [...]} (or of id lists)."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[object]: ...


class TrlCounts(NamedTuple):
    """What `set_trl_sizes` derived: the episodes and the updates (`total_episodes`, `num_total_batches`)."""

    total_episodes: int
    updates: int


def check_arguments(
    args: object,
    model: nn.Module,
    ref_model: nn.Module | None,
    reward_model: nn.Module | None,
    value_model: nn.Module | None,
    train_dataset: PromptDataset | None,
    data_collator: object,
    optimizers: tuple[object, object] | None,
) -> None:
    """TRL's constructor arguments that lmppo cannot take, each refused in one line."""
    if not isinstance(args, TrainingArguments):
        raise LmppoError(f"args must be an lmppo.trl.PPOConfig, got a {type(args).__name__}")
    if train_dataset is None:
        raise ConfigError("train_dataset", None, "is required")
    if ref_model is not None and ref_model is model:
        raise ConfigError(
            "ref_model",
            "the policy model",
            "must not be `model` itself: pass a copy, or None (a "
            "copy of the initial policy; with peft_config, the policy with its adapters off)",
        )
    if data_collator is not None:
        raise ConfigError(
            "data_collator",
            type(data_collator).__name__,
            f"lmppo left-pads the `input_ids` column itself; pass data_collator=None (see {DOCS})",
        )
    if optimizers is not None and any(o is not None for o in optimizers):
        raise ConfigError(
            "optimizers",
            optimizers,
            "lmppo builds its own AdamW and schedule from the PPOConfig; pass (None, None)",
        )
    if value_model is None or reward_model is None:
        raise ConfigError("value_model" if value_model is None else "reward_model", None, "is required, as in TRL")


def with_adapters(model: nn.Module, peft_config: PeftConfig | None) -> nn.Module:
    """`model` with peft's adapters of `peft_config` (None: as it is), as TRL's constructor wraps it."""
    if peft_config is None:
        return model
    from peft import PeftModel, get_peft_model

    if isinstance(model, PeftModel):
        raise ConfigError(
            "peft_config",
            type(peft_config).__name__,
            "was given with a model that is already "
            "a PeftModel: merge and unload the adapter first, or pass peft_config=None",
        )
    return get_peft_model(model, peft_config)


def set_trl_sizes(args: PPOConfig, world: int, num_prompts: int) -> TrlCounts:
    """The batch sizes and counts TRL's PPOTrainer derives from its config and writes into `args`."""
    local_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
    batch = local_batch * world
    args.world_size = world
    args.local_batch_size = local_batch
    args.micro_batch_size = args.per_device_train_batch_size * world
    args.batch_size = batch
    if local_batch % args.num_mini_batches:
        raise ConfigError(
            "num_mini_batches",
            args.num_mini_batches,
            f"must divide local_batch_size ({local_batch} = per_device_train_batch_size x gradient_accumulation_steps)",
        )
    args.mini_batch_size = batch // args.num_mini_batches
    args.local_mini_batch_size = local_batch // args.num_mini_batches
    episodes = args.total_episodes if args.total_episodes is not None else int(args.num_train_epochs * num_prompts)
    args.total_episodes = episodes
    args.num_total_batches = math.ceil(episodes / batch)
    return TrlCounts(episodes, args.num_total_batches)


def prompt_ids(dataset: PromptDataset) -> list[Sequence[int]]:
    """The prompt token ids of a TRL dataset: its `input_ids` column (a `datasets.Dataset`, or any sequence of rows
    {"input_ids": [...]}), checked as every lmppo prompt source."""

    rows = (
        dataset
        if is_hf_dataset(dataset)
        else [r["input_ids"] if isinstance(r, dict) and "input_ids" in r else r for r in dataset]
    )
    return list(load_prompt_records(DataConfig(field="input_ids"), rows))


def internal_tokenizer(tokenizer: PreTrainedTokenizerBase, model: nn.Module) -> PreTrainedTokenizerBase:
    """The tokenizer lmppo pads with: the one given, or a copy padding with eos when its pad id is outside the
    policy's embedding table (TRL scripts add a `[PAD]` token the model never learnt; TRL replaces padding by id 0
    before each forward pass, lmppo pads with an id the model has). A fast tokenizer's copy also drops that pad
    token, so its size fits the embedding (lmppo refuses a tokenizer with ids the model has no row for)."""

    rows = parameter(hf_model(model).get_input_embeddings(), "weight").shape[0]  # (V, H)
    pad = tokenizer.pad_token_id
    if pad is not None and pad < rows:
        return tokenizer
    if tokenizer.eos_token_id is None or tokenizer.eos_token_id >= rows:
        raise ConfigError(
            "processing_class",
            type(tokenizer).__name__,
            f"pad token id {pad} is outside the policy's "
            f"{rows} embeddings and there is no eos token to pad with instead",
        )
    internal = copy.deepcopy(tokenizer)
    old_pad = internal.pad_token
    internal.pad_token = internal.eos_token
    backend = getattr(internal, "backend_tokenizer", None)
    if pad is not None and backend is not None:  # the unused pad token leaves the copy: len() fits the embedding
        data = json.loads(backend.to_str())
        data["added_tokens"] = [t for t in data["added_tokens"] if not (t["id"] >= rows and t["content"] == old_pad)]
        internal._tokenizer = Tokenizer.from_str(json.dumps(data))  # the backend a fast tokenizer wraps
    return internal
