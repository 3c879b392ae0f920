"""Fingerprints of what a run reads (its prompt data, the model folders it names), recorded in every checkpoint and
compared on resume: a prompt file shuffled or edited under a stopped run, or a reward model replaced, is named in
one line instead of giving another model silently; a model folder moved with identical content is accepted."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from lmppo.config import BUILTIN_MODELS, Config
from lmppo.errors import ConfigError
from lmppo.models.loading import model_fields


@dataclass
class Fingerprints:
    """What a resume compares with a checkpoint besides the config: the inputs (`input_fingerprints`) and the
    weights training does not change (`lmppo.run.checkpoint.frozen_fingerprint`, hashed at the first checkpoint)."""

    inputs: dict[str, str]
    frozen: Optional[str] = None


ACCEPT_FLAG = "--accept-changed-inputs"
"""The `lmppo train --resume` flag that resumes on inputs that changed (the new fingerprints are recorded)."""
_CHUNK = 1 << 20


def fingerprint_records(records: Sequence[object]) -> str:
    """sha256 of the prompt records as lmppo read them (text, extra columns and order): the same for a file, a
    dataset or a list passed to the API, whatever the format."""
    columns = getattr(records, "columns", None)
    payload = json.dumps([list(records), columns], sort_keys=True, default=str, ensure_ascii=False)
    return "sha256:" + hashlib.sha256(payload.encode("utf-8")).hexdigest()


def fingerprint_folder(folder: str) -> str:
    """sha256 over the names and bytes of the files of model folder `folder` (not hidden files, not README.md):
    the same for a copy or a moved folder, another one when any weight, config or tokenizer file differs."""
    digest = hashlib.sha256()
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if name.startswith(".") or name == "README.md":
                continue
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, folder).replace(os.sep, "/").encode() + b"\0")
            with open(path, "rb") as fh:
                while block := fh.read(_CHUNK):
                    digest.update(block)
            digest.update(b"\0")
    return "sha256:" + digest.hexdigest()


def model_fingerprints(cfg: Config) -> dict[str, str]:
    """Field -> fingerprint of every local model folder the run names (built-in names and Hub ids are identified by
    their name: their caches are keyed by content already)."""
    return {
        field: fingerprint_folder(value)
        for field, value in model_fields(cfg)
        if value not in BUILTIN_MODELS and os.path.isdir(value)
    }


def input_fingerprints(cfg: Config, records: Sequence[object]) -> dict[str, str]:
    """What a checkpoint records of the run's inputs: `data.prompts` and the model folders (`model_fingerprints`)."""
    return {"data.prompts": fingerprint_records(records), **model_fingerprints(cfg)}


def moved_folders(cfg: Config, saved_config: Mapping[str, object], saved_inputs: Mapping[str, str]) -> dict[str, str]:
    """Model fields whose folder is not the one the run recorded but holds the same files (`mv MODEL NEW`):
    field -> the recorded value, which a resume may then take as unchanged."""
    moved = {}
    for field, value in model_fields(cfg):
        old = _get(saved_config, field)
        recorded = saved_inputs.get(field)
        if old != value and recorded and os.path.isdir(value) and fingerprint_folder(value) == recorded:
            moved[field] = str(old)
    return moved


def check_unchanged(
    cfg: Config, saved_inputs: Mapping[str, str], current: Mapping[str, str], where: str, accept: bool
) -> list[str]:
    """The recorded inputs of checkpoint `where` that differ now; a ConfigError naming the first unless `accept`
    (`lmppo train --resume RUN --accept-changed-inputs`). Inputs the checkpoint did not record (an older lmppo)
    are not compared."""
    changed = [name for name, value in saved_inputs.items() if name in current and current[name] != value]
    if changed and not accept:
        what = "the prompt data" if changed[0] == "data.prompts" else "the model folder"
        others = f" (and {', '.join(changed[1:])})" if len(changed) > 1 else ""
        raise ConfigError(
            changed[0],
            _get(cfg.to_dict(), changed[0]),
            f"{what} differs from what the checkpoint {where} was trained on{others} (edited, shuffled or replaced "
            f"since): the resumed run would not continue the same run. Put the original back, or resume on the new "
            f"one with `lmppo train --resume RUN {ACCEPT_FLAG}`",
        )
    return changed


def _get(data: object, dotted: str) -> object:
    for part in dotted.replace("[", ".").replace("]", "").split("."):
        if isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        elif isinstance(data, dict) and part in data:
            data = data[part]
        else:
            return None
    return data
