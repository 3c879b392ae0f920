"""Model names a config field may hold: built-in names, Hugging Face Hub ids (`ORG/NAME`, `hub:ORG/NAME`) and
local folders."""

from __future__ import annotations

import os
import re

from lmppo.errors import ConfigError

BUILTIN_MODELS = ("smollm2",)
"""Model names resolved by lmppo itself (see ``lmppo.models.assets``) rather than as a folder."""

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


def check_model_path(path: str, name: str) -> None:
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
