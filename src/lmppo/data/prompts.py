"""Prompts: reading them, tokenizing them, and the seeded order in which they are drawn.

Design notes: docs/design.md, `lmppo.data.prompts`."""

from __future__ import annotations

import numbers
import os
import warnings
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any, Iterable, Sequence

import torch

import lmppo.models.assets
from lmppo.config import Config, DataConfig
from lmppo.data.generated import generated_records, is_generated
from lmppo.data.hf_datasets import dataset_format, dataset_records, is_hf_dataset, load_dataset_path
from lmppo.data.prompt_files import check_prompt_file, did_you_mean, field_names, read_prompt_file, short_repr
from lmppo.errors import ConfigError, DataError


class PromptRecords(list):
    """A list of prompt records that remembers where each came from (for error messages)."""

    source: str = "prompts"
    """The file (or `builtin:NAME`, or `prompts passed to the API`)."""
    locations: list[str]
    """Per record: `line 7`, or `item 3` for lists."""
    columns: list[dict[str, Any]]
    """Per record: its fields other than the prompt (empty dicts when there are none)."""

    def where(self, index: int) -> str:
        locs = getattr(self, "locations", None)
        loc = locs[index] if locs and index < len(locs) else f"item {index}"
        return f"{self.source}, {loc}"


def _where(records: Sequence[Any], index: int) -> str:
    return records.where(index) if isinstance(records, PromptRecords) else f"prompt {index}"


# ----------------------------------------------------------------------------- loading


def run_prompt_records(cfg: Config, prompts: Iterable[object] | None = None) -> PromptRecords:
    """The prompt records of run `cfg` (`load_prompt_records`, a generated set sized and seeded from the run)."""
    return load_prompt_records(cfg.data, prompts, seed=cfg.data.holdout_seed_for(cfg.seed), size=generated_size(cfg))


def generated_size(cfg: Config) -> int:
    """Rows of a generated set (`lmppo.data.generated`) when `data.size` is 0: the prompts the run draws plus the
    held-out ones."""
    per_iteration = cfg.rollout.batch_size // cfg.rollout.num_samples_per_prompt
    return max(1, cfg.num_iterations) * per_iteration + cfg.data.holdout


def load_prompt_records(
    data_cfg: DataConfig, prompts: Iterable[object] | None = None, *, seed: int = 0, size: int = 0
) -> PromptRecords:
    """The prompt records of ``data_cfg.prompts`` (a file, ``builtin:NAME`` or a generated set: `size` rows from
    data seed `seed`, `data.size` when set), or of ``prompts`` when given."""
    if prompts is not None:
        if is_hf_dataset(prompts):  # a datasets.Dataset object: its `data.field` column
            return _load_dataset(prompts, data_cfg, "the datasets.Dataset passed to the API")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise DataError(f"prompts passed to the API must be a list of records, got a {type(prompts).__name__}")
        return _records(
            list(prompts),
            "prompts passed to the API",
            [f"item {i}" for i in range(len(prompts))],
            field_name=data_cfg.field,
        )
    spec = data_cfg.prompts
    if is_generated(spec):
        rows = generated_records(
            spec, data_cfg.size or size or 1, seed, data_cfg.task_options, data_cfg.task_instruction
        )
        return _records(list(rows), spec, [f"row {i}" for i in range(len(rows))], field_name="prompt")
    if spec.startswith("builtin:"):
        name = spec[len("builtin:") :]
        items = list(lmppo.models.assets.builtin_records(name))
        return _records(items, spec, [f"item {i}" for i in range(len(items))], field_name="prompt")
    check_prompt_file(data_cfg)  # a FIFO or a device: refused, never opened
    hf_format = dataset_format(spec, data_cfg.format) if os.path.exists(spec) else None
    if hf_format is not None:  # a save_to_disk folder, Parquet or Arrow: read through `datasets`
        return _load_dataset(load_dataset_path(spec, hf_format), data_cfg, f"prompt dataset `{spec}`")
    items, locations, columns = read_prompt_file(spec, data_cfg)
    return _records(items, spec, locations, columns)


def _load_dataset(ds: Any, data_cfg: DataConfig, source: str) -> PromptRecords:
    """Records of a Hugging Face dataset's prompt column (``lmppo.data.hf_datasets``)."""

    items, locations, column, columns = dataset_records(ds, data_cfg.field, source)
    return _records(items, f"{source}, column `{column}`", locations, columns)


def _records(
    items: list, source: str, locations: list[str], columns: list[dict] | None = None, field_name: str = "prompt"
) -> PromptRecords:
    """Checked records. Without `columns` (API, built-in sets) a dict item is a record: its `field_name` is the
    prompt and its other keys are the columns; a file reader has taken the prompt out already (`columns` given)."""
    if not items:
        raise DataError(f"{source}: holds no prompts")
    split = columns is None
    columns = list(columns) if columns is not None else [{} for _ in items]
    for i, x in enumerate(items):
        if split and isinstance(x, dict) and not _is_message(x):
            if field_name not in x:
                raise DataError(
                    f"{source}, {locations[i]}: the record has no field `{field_name}` (it has "
                    f"{field_names(x)}{did_you_mean(field_name, list(x))}); data.field names the field that holds "
                    "the prompt, the other fields are passed to reward functions by name"
                )
            items[i], columns[i] = x[field_name], {k: v for k, v in x.items() if k != field_name}
    out = PromptRecords(_check_record(x, f"{source}, {loc}") for x, loc in zip(items, locations))
    out.source, out.locations, out.columns = source, locations, columns
    return out


def _is_message(x: dict) -> bool:
    """A lone chat message given where a record was expected (refused by `_check_record` with its message)."""
    return "role" in x and "content" in x and len(x) <= 3


def _check_record(value: Any, where: str) -> Any:
    """The record if it is a non-empty string, a list of chat messages or a list of token ids."""
    allowed = 'a string, a list of chat messages ({"role", "content"}) or a list of token ids'
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: the prompt is an empty string")
        return value
    if isinstance(value, (list, tuple)):
        if not value:
            raise DataError(f"{where}: the prompt is an empty list; must be {allowed}")
        if all(isinstance(x, dict) for x in value):
            for j, m in enumerate(value):
                missing = [k for k in ("role", "content") if k not in m]
                if missing:
                    raise DataError(
                        f"{where}: chat message {j} has no `{'` or `'.join(missing)}` (it has "
                        f"{field_names(m)}); each message needs `role` and `content`"
                    )
                if not isinstance(m["role"], str) or not m["role"]:
                    raise DataError(
                        f"{where}: chat message {j} has role {m['role']!r}; must be a non-empty string "
                        "such as `system`, `user` or `assistant`"
                    )
                if not isinstance(m["content"], str):
                    raise DataError(
                        f"{where}: chat message {j} has content {short_repr(m['content'])} of type "
                        f"{type(m['content']).__name__}; must be a string"
                    )
            return [dict(m) for m in value]
        for j, x in enumerate(value):
            if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                raise DataError(
                    f"{where}: item {j} of the list is {short_repr(x)} ({type(x).__name__}); a list must "
                    "hold only chat messages or only token ids (integers)"
                )
        return [int(x) for x in value]
    raise DataError(f"{where}: the prompt is {short_repr(value)} ({type(value).__name__}); must be {allowed}")


# ----------------------------------------------------------------------------- tokenizing


@dataclass
class PromptSet:
    ids: list[list[int]]
    """Per prompt, the token ids the policy is conditioned on (after truncation)."""
    texts: list[str]
    """Per prompt, the decoded ids (special tokens and chat template included): what the policy sees."""
    columns: list[dict[str, Any]] = dc_field(default_factory=list)
    """Per prompt, the record's other fields (a reference answer, metadata), for reward functions that take them
    by name; empty when the records had none."""
    shown: list[str] = dc_field(default_factory=list)
    """Per prompt, the prompt as a person wrote it, for tables: a chat prompt's messages as text (no template
    tokens, no system prompt the template adds), token ids decoded without special tokens; empty: `texts`."""

    def __len__(self) -> int:
        return len(self.ids)

    def shown_text(self, i: int) -> str:
        """Prompt `i` as a table shows it."""
        return self.shown[i] if self.shown else self.texts[i]

    def subset(self, index: Sequence[int]) -> "PromptSet":
        """The prompts `index`, in that order, with their columns and shown texts."""
        return PromptSet(
            ids=[self.ids[i] for i in index],
            texts=[self.texts[i] for i in index],
            columns=self.columns_of(index) if self.columns else [],
            shown=[self.shown[i] for i in index] if self.shown else [],
        )

    def columns_of(self, index: Sequence[int]) -> list[dict[str, Any]]:
        """The columns of prompts `index` (empty dicts when the set has none)."""
        return [self.columns[i] if i < len(self.columns) else {} for i in index]


def tokenize_prompts(records: Sequence[Any], tokenizer: Any, data_cfg: DataConfig) -> PromptSet:
    """Token ids and texts of the prompt records (see the module docstring for the choices)."""
    limit = data_cfg.max_prompt_length
    if limit < 1:
        raise DataError(f"data.max_prompt_length = {limit}: must be >= 1")
    if data_cfg.long_prompts not in ("truncate_left", "error"):
        raise DataError(f"data.long_prompts = {data_cfg.long_prompts!r}: must be `truncate_left` or `error`")
    vocab = len(tokenizer)
    ids_all: list[list[int]] = []
    shown: list[str] = []
    cut, longest = 0, 0
    if not isinstance(records, PromptRecords):  # records from load_prompt_records are checked already
        records = [_check_record(rec, _where(records, i)) for i, rec in enumerate(records)]
    plain = [i for i, rec in enumerate(records) if isinstance(rec, str) and not data_cfg.chat_template]
    encoded = dict(zip(plain, tokenizer([records[i] for i in plain])["input_ids"])) if plain else {}  # one call
    for i, rec in enumerate(records):
        if i in encoded:
            ids = list(encoded[i])
        elif isinstance(rec, str) or (isinstance(rec, list) and rec and isinstance(rec[0], dict)):
            messages = [{"role": "user", "content": rec}] if isinstance(rec, str) else rec
            ids = _apply_template(tokenizer, messages, _where(records, i), isinstance(rec, str))
        elif isinstance(rec, list) and rec:
            ids = [int(t) for t in rec]
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise DataError(
                    f"{_where(records, i)}: token id {bad} is outside the tokenizer's vocabulary "
                    f"(ids must be in 0..{vocab - 1})"
                )
        else:
            raise DataError(
                f"{_where(records, i)}: the prompt is {short_repr(rec)}; must be a string, a list of chat "
                "messages or a list of token ids"
            )
        if not ids:
            raise DataError(f"{_where(records, i)}: the prompt has no tokens")
        if len(ids) > limit:
            if data_cfg.long_prompts == "error":
                raise DataError(
                    f"{_where(records, i)}: the prompt is {len(ids)} tokens, longer than "
                    f"data.max_prompt_length = {limit} (raise it, or set data.long_prompts = "
                    "truncate_left to keep the last tokens)"
                )
            cut, longest = cut + 1, max(longest, len(ids))
            ids = _truncate_left(ids, limit, tokenizer.bos_token_id)
            rec = ids  # shown as what is left of it
        ids_all.append(ids)
        shown.append(readable_prompt(rec, tokenizer))
    if cut:
        source = records.source if isinstance(records, PromptRecords) else "the prompts"
        warnings.warn(
            f"{cut} of {len(ids_all)} prompts in {source} are longer than data.max_prompt_length = "
            f"{limit} tokens (the longest has {longest}) and were cut on the left, keeping their end",
            UserWarning,
            stacklevel=2,
        )
    texts = tokenizer.batch_decode(ids_all, skip_special_tokens=False) if ids_all else []
    columns = list(getattr(records, "columns", None) or [])
    return PromptSet(ids=ids_all, texts=texts, columns=columns if any(columns) else [], shown=shown)


def readable_prompt(record: Any, tokenizer: Any) -> str:
    """A prompt record as a person reads it: a string as it is; chat messages as their text (one user message: its
    content; more: `role: content` lines); token ids decoded without special tokens."""
    if isinstance(record, str):
        return record
    if record and isinstance(record[0], dict):
        if len(record) == 1 and record[0].get("role") == "user":
            return str(record[0].get("content", ""))
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in record)
    return tokenizer.decode(list(record), skip_special_tokens=True)


def _apply_template(tokenizer: Any, messages: list[dict], where: str, wrapped: bool) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        why = "data.chat_template is set" if wrapped else "the prompt is a list of chat messages"
        raise DataError(
            f"{where}: {why}, but the tokenizer has no chat template (use a chat/instruct "
            "tokenizer, or give plain-text prompts with data.chat_template = false)"
        )
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    except Exception as err:
        raise DataError(
            f"{where}: the tokenizer's chat template refused the messages: {type(err).__name__}: {err}"
        ) from None
    if isinstance(out, dict) or hasattr(out, "input_ids"):  # BatchEncoding on some versions
        out = out["input_ids"]
    return [int(t) for t in out]


def _truncate_left(ids: list[int], limit: int, bos_id: int | None) -> list[int]:
    """The last `limit` tokens, keeping a leading BOS in front."""
    if bos_id is not None and ids[0] == bos_id and limit > 1:
        return [bos_id] + ids[len(ids) - (limit - 1) :]
    return ids[len(ids) - limit :]


# ----------------------------------------------------------------------------- order


class PromptStream:
    """Batches of prompt indices: a seeded permutation per pass over the data, wrapping around across passes.

    ``next_batch()`` returns the next ``batch_size`` indices (the global batch). A batch that crosses the end of a
    pass takes the rest of this pass and the start of the next one; when ``batch_size <= num_prompts`` the next
    pass's first prompts that are already in the batch are deferred to its next batch, so a batch never holds a
    prompt twice and every pass still draws every prompt exactly once. With more prompts per batch than prompts,
    repeats are unavoidable (each prompt then appears about ``batch_size / num_prompts`` times).

    The order of pass p depends only on (seed, p), from its own ``torch.Generator`` (the global RNG is never
    touched), so the state is three small numbers and a short list. Multi-process: every rank keeps an identical
    stream and calls ``next_batch(rank, world_size)``, which returns that rank's contiguous slice of the same global
    batch (``batch_size`` must be divisible by ``world_size``).
    """

    def __init__(self, num_prompts: int, batch_size: int, seed: int = 0, shuffle: bool = True, retire_after: int = 0):
        if num_prompts < 1:
            raise DataError(f"PromptStream: num_prompts = {num_prompts}; there must be at least one prompt")
        if batch_size < 1:
            raise DataError(f"PromptStream: batch_size = {batch_size}; must be >= 1")
        self.num_prompts, self.batch_size = int(num_prompts), int(batch_size)
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.epoch = 0  # the pass the next prompt comes from
        self.pos = 0  # prompts of this pass's permutation already consumed (carry aside)
        self.carry: list[int] = []  # prompts of this pass deferred to its next batch
        self._perm_cache: tuple[int, list[int]] | None = None
        self.retire_after = int(retire_after)  # `data.retire_settled_after`; 0: every prompt stays
        self.settled_streak: dict[int, int] = {}  # prompt -> its last visits in a row whose group all scored alike
        self.retired: set[int] = set()  # prompts no longer drawn
        self.last_batch: list[int] = []  # the global batch `next_batch` drew last

    def _perm(self, epoch: int) -> list[int]:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (2**63 - 1))
                perm = torch.randperm(self.num_prompts, generator=g).tolist()
            else:
                perm = list(range(self.num_prompts))
            self._perm_cache = (epoch, perm)
        return self._perm_cache[1]

    def _global_batch(self) -> list[int]:
        out: list[int] = []
        deferred: list[int] = []  # prompts of the next pass already in this batch: its next batch takes them first
        no_repeats = self.batch_size <= self.num_prompts
        while len(out) < self.batch_size:
            if self.carry:
                prompt = self.carry.pop(0)
            elif self.pos < self.num_prompts:
                prompt = self._perm(self.epoch)[self.pos]
                self.pos += 1
            else:  # this pass is over (its carry taken): the next one
                self.epoch, self.pos = self.epoch + 1, 0
                continue
            if prompt in self.retired:
                continue
            if no_repeats and prompt in out:
                deferred.append(prompt)
            else:
                out.append(prompt)
        self.carry += deferred
        return out

    def record_settled(self, settled: Sequence[bool]) -> None:
        """Whether each prompt of the last global batch was settled: its group's responses all scored alike (every
        sample solved it, or none did). A prompt settled on each of its last `retire_after` visits is not drawn
        again, as long as at least one batch of prompts stays in play (`data.retire_settled_after`)."""
        if not self.retire_after:
            return
        if len(settled) != len(self.last_batch):
            raise ValueError(f"{len(settled)} settled flags for a batch of {len(self.last_batch)} prompts")
        for prompt, done in zip(self.last_batch, settled):
            self.settled_streak[prompt] = self.settled_streak.get(prompt, 0) + 1 if done else 0
            in_play = self.num_prompts - len(self.retired)
            if self.settled_streak[prompt] >= self.retire_after and in_play > self.batch_size:
                self.retired.add(prompt)

    def next_batch(self, rank: int = 0, world_size: int = 1) -> list[int]:
        """The next global batch of prompt indices, or rank `rank`'s slice of it."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} with world_size {world_size}: need 0 <= rank < world_size")
        if self.batch_size % world_size:
            raise DataError(f"the prompt batch size {self.batch_size} is not divisible by the {world_size} processes")
        batch = self._global_batch()
        self.last_batch = batch
        per = self.batch_size // world_size
        return batch[rank * per : (rank + 1) * per]

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_prompts": self.num_prompts,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "pos": self.pos,
            "carry": list(self.carry),
            "retired": sorted(self.retired),
            "settled_streak": [[prompt, n] for prompt, n in sorted(self.settled_streak.items())],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_prompts", "batch_size", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"cannot resume the prompt order: the checkpoint has {key} = {state[key]!r}, this "
                    f"run has {getattr(self, key)!r} (the prompts or data settings changed)"
                )
        self.epoch, self.pos, self.carry = int(state["epoch"]), int(state["pos"]), [int(x) for x in state["carry"]]
        self.retired = {int(x) for x in state.get("retired", [])}  # (absent from an older lmppo's checkpoint)
        self.settled_streak = {int(prompt): int(n) for prompt, n in state.get("settled_streak", [])}


# ----------------------------------------------------------------------------- helpers


def split_holdout(prompts, holdout: int, seed: int):
    """(training prompts, held-out prompts): `holdout` prompts picked by a seeded permutation."""
    n = len(prompts.ids)
    if holdout >= n:
        raise ConfigError("data.holdout", holdout, f"must be smaller than the number of prompts ({n})")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 7)).tolist()
    held = set(order[:holdout])

    def pick(keep):
        return prompts.subset([i for i in range(n) if (i in held) == keep])

    return pick(False), pick(True)
