"""Checks of a model folder before `from_pretrained` reads it, and one clear error when loading fails anyway.

A broken folder (an empty, truncated or garbage `model.safetensors`, an invalid `config.json`, no weights file,
no tokenizer files) otherwise ends in a traceback from deep inside transformers or safetensors. Here it is one
`LmppoError` naming the folder, the file and what is wrong with it. The checks read headers only (a few bytes
per file), never the weights.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import warnings
from contextlib import contextmanager
from typing import Iterator

from lmppo.errors import LmppoError

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")
_MAX_HEADER = 100 * 1024 * 1024


class ModelFolderError(LmppoError, ValueError):
    """A model folder is missing a file, or a file in it is corrupt."""


def is_adapter_folder(folder: str) -> bool:
    """A LoRA adapter folder (peft's adapter_config.json), rather than a full model."""
    return os.path.isfile(os.path.join(folder, "adapter_config.json"))


def _bad(what: str, folder: str, name: str, why: str) -> ModelFolderError:
    return ModelFolderError(f"{what} {folder}: {name} {why}")


def _json_file(what: str, folder: str, name: str) -> dict:
    path = os.path.join(folder, name)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(64 * 1024 * 1024 + 1)
    except OSError as err:
        raise _bad(what, folder, name, f"cannot be read ({err.strerror or err})") from None
    if not raw.strip():
        raise _bad(what, folder, name, "is empty")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise _bad(what, folder, name, "is not UTF-8 text (corrupt?)") from None
    except json.JSONDecodeError as err:
        raise _bad(
            what, folder, name, f"is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})"
        ) from None
    if not isinstance(data, dict):
        raise _bad(what, folder, name, f"must hold a JSON object, not a {type(data).__name__}")
    return data


def check_json_file(folder: str, name: str, what: str = "model") -> None:
    """`folder/name` exists and holds a JSON object (ModelFolderError naming the folder and the file otherwise)."""
    if not os.path.isfile(os.path.join(folder, name)):
        raise _bad(what, folder, name, "is missing")
    _json_file(what, folder, name)


def check_safetensors(what: str, folder: str, name: str) -> None:
    """`folder/name` is a complete safetensors file: its header parses and the file is as long as it says."""
    path = os.path.join(folder, name)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if size == 0:
                raise _bad(what, folder, name, "is empty (0 bytes; an interrupted download or copy?)")
            if len(head) < 8:
                raise _bad(what, folder, name, f"is truncated ({size} bytes, not even a header)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                raise _bad(
                    what,
                    folder,
                    name,
                    f"is not a safetensors file or is truncated ({size} bytes; its header length field says {n})",
                )
            raw = fh.read(n)
    except OSError as err:
        raise _bad(what, folder, name, f"cannot be read ({err.strerror or err})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError):
        raise _bad(what, folder, name, "is not a safetensors file (its header is not valid)") from None
    if 8 + n + end != size:
        raise _bad(what, folder, name, f"is truncated or corrupt: it has {size} bytes, its header says {8 + n + end}")


def check_model_folder(folder: str, what: str = "model", allow_pickle: bool = False) -> None:
    """Raise ModelFolderError naming the file when local model folder `folder` cannot be a loadable model."""
    if not os.path.isdir(folder):
        return  # a hub id or a built-in name: resolved and checked elsewhere
    files = set(os.listdir(folder))
    if "config.json" not in files and "adapter_config.json" not in files:
        raise _bad(what, folder, "config.json", "is missing (not a Hugging Face model folder?)")
    for name in ("config.json", "adapter_config.json"):
        if name in files:
            _json_file(what, folder, name)
    weights = [f for f in WEIGHT_FILES if f in files] or sorted(f for f in files if f.endswith(".safetensors"))
    if not weights:
        raise _bad(
            what,
            folder,
            "model.safetensors",
            "is missing: the folder holds no weights file "
            "(model.safetensors, or a sharded model.safetensors.index.json)",
        )
    for name in weights:
        if name.endswith(".safetensors"):
            check_safetensors(what, folder, name)
        elif name.endswith(".index.json"):
            index = _json_file(what, folder, name)
            shards = (
                sorted(set((index.get("weight_map") or {}).values()))
                if isinstance(index.get("weight_map"), dict)
                else []
            )
            if not shards:
                raise _bad(what, folder, name, "has no weight_map")
            for shard in shards:
                if not isinstance(shard, str) or os.path.basename(shard) != shard:
                    raise _bad(what, folder, name, f"names a shard outside the folder: {str(shard)[:100]!r}")
                if shard not in files:
                    raise _bad(what, folder, shard, f"is missing (listed in {name})")
                if shard.endswith(".safetensors"):
                    check_safetensors(what, folder, shard)
        elif os.path.getsize(os.path.join(folder, name)) == 0:
            raise _bad(what, folder, name, "is empty")


def check_tokenizer_folder(folder: str, what: str = "tokenizer") -> None:
    """Raise ModelFolderError naming the file when local folder `folder` holds no usable tokenizer files."""
    if not os.path.isdir(folder):
        return
    files = set(os.listdir(folder))
    if not any(f in files for f in TOKENIZER_FILES):
        raise _bad(
            what,
            folder,
            "tokenizer.json",
            "is missing: the folder holds no tokenizer files "
            f"({', '.join(TOKENIZER_FILES)}); give model.tokenizer a folder that has them",
        )
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json"):
        if name in files:  # config.json: transformers reads it to pick the tokenizer class
            _json_file("model folder" if name == "config.json" else what, folder, name)


@contextmanager
def loading(what: str, folder: str) -> Iterator[None]:
    """Any failure of `from_pretrained` inside the block becomes one error naming the folder. transformers logs its
    load report (the tensors whose shapes differ from config.json) and then raises "look at the above report",
    which the console never shows: the report is caught here and its first mismatch goes into the message."""
    report = _ReportCatcher()
    try:
        with report:
            yield
    except LmppoError:
        raise
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except BaseException as err:  # noqa: BLE001 - transformers/safetensors/tokenizers raise anything
        text = " ".join(str(err).split())
        if "above report" in text:
            text = report.mismatch_text() or "the weights do not have the shapes the folder's config.json gives"
        else:
            text = f"{type(err).__name__}: {text}"
            text = text if len(text) <= 300 else text[:300] + " ..."
        raise ModelFolderError(f"cannot load the {what} from {folder}: {text}") from err


_MISMATCH = re.compile(
    r"^\s*(\S+)\s*\|\s*MISMATCH\b.*?ckpt:\s*torch\.Size\(\[([\d, ]*)\]\)\s*vs\s*model:\s*torch\.Size\(\[([\d, ]*)\]\)"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class _ReportCatcher(logging.Handler):
    """Holds the warnings of transformers' model loading (its load report) for the block, instead of the console."""

    LOGGER = "transformers.modeling_utils"

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(_ANSI.sub("", record.getMessage()))

    def __enter__(self) -> "_ReportCatcher":
        logger = logging.getLogger(self.LOGGER)
        self._saved = (logger.level, logger.propagate)
        logger.setLevel(logging.WARNING)
        logger.propagate = False  # what the console showed before: nothing below the CLI's error level
        logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logger = logging.getLogger(self.LOGGER)
        logger.removeHandler(self)
        logger.setLevel(self._saved[0])
        logger.propagate = self._saved[1]
        if exc[0] is None:  # loaded: pass the warnings on as transformers would have
            for message in self.messages:
                logger.warning(message)

    def mismatch_text(self) -> str | None:
        rows = [m.groups() for text in self.messages for line in text.splitlines() if (m := _MISMATCH.match(line))]
        if not rows:
            return None
        key, ckpt, model = rows[0]
        more = f" (and {len(rows) - 1} more tensors)" if len(rows) > 1 else ""
        return (
            f"the weights do not have the shapes its config.json gives: `{key}` is [{ckpt}] in the weights file, "
            f"[{model}] by config.json{more}; the config.json is another model's (hidden_size, vocab_size?)"
        )


def _names(keys: list[str], shown: int = 4) -> str:
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return ", ".join(f"`{k}`" for k in keys[:shown]) + more


def check_loaded_whole(info: dict, what: str, folder: str, strict: bool, new_head: tuple[str, ...] = ()) -> list[str]:
    """The load report of `from_pretrained(..., output_loading_info=True)` (`info`): a weight the model needs that
    the folder lacks (it would start random), a weight the folder holds that the model has no place for (it would be
    dropped: a config.json with fewer layers than the weights), or one of another shape is one ModelFolderError
    naming the tensors, whatever the console shows. `strict` False (`model.strict: false`): one warning instead.
    `new_head`: key prefixes that are new by design (a critic's `score.` head on a causal LM, whose `lm_head.` goes);
    returns the keys of `new_head` the folder lacked (they start random: the caller initialises them)."""
    missing = sorted(k for k in info.get("missing_keys") or [] if not k.startswith(new_head))
    unexpected = sorted(k for k in info.get("unexpected_keys") or [] if not (new_head and k.startswith(("lm_head.",))))
    mismatched = sorted(
        str(m[0]) if isinstance(m, (tuple, list)) else str(m) for m in info.get("mismatched_keys") or []
    )
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} tensor(s) the model needs are not in the weights (they would start random): "
            f"{_names(missing)}"
        )
    if unexpected:
        problems.append(
            f"{len(unexpected)} tensor(s) in the weights have no place in the model (they would be "
            f"dropped): {_names(unexpected)}"
        )
    if mismatched:
        problems.append(f"{len(mismatched)} tensor(s) have another shape than config.json gives: {_names(mismatched)}")
    fresh = sorted(k for k in info.get("missing_keys") or [] if new_head and k.startswith(new_head))
    if not problems:
        return fresh
    text = f"the {what} in {folder} is not what its config.json describes: " + "; ".join(problems)
    if strict:
        raise ModelFolderError(
            text + " (config.json and the weights are from different models?); fix the folder, or set "
            "model.strict: false to load it anyway"
        )
    warnings.warn(text + " (loaded anyway: model.strict is false)", UserWarning, stacklevel=3)
    return fresh


def load_whole(from_pretrained, path: str, what: str, strict: bool, new_head: tuple[str, ...] = (), **kwargs):  # noqa: ANN001, ANN201 - any transformers auto class's loader
    """`from_pretrained(path, **kwargs)` with its load report checked (`check_loaded_whole`); returns the model."""
    model, info = from_pretrained(path, output_loading_info=True, **kwargs)
    check_loaded_whole(info, what, path, strict, new_head)
    return model
