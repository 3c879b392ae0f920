"""Hugging Face Hub model ids as model paths: downloaded once into the Hub's own cache, then read as a folder.

A model field (`model.policy`, `model.tokenizer`, `value.init_from`, a reward source's `path`, `lmppo eval`'s
model) takes a local folder, `hub:ORG/NAME`, or a bare `ORG/NAME` that is not a local folder (a local folder of
that name wins). The download keeps safetensors, configs and tokenizer files (pickle weights only with
`model.allow_pickle`), so the folder checks of `lmppo.models.files` apply to Hub models as to local ones. When the
Hub cannot be reached (`HF_HUB_OFFLINE=1`, no network, a wrong `HF_ENDPOINT`) and the model is not in the local
Hub cache, the error is one line naming the field, the id and the reason.
"""

from __future__ import annotations

import os

from lmppo.config import is_hub_repo_id
from lmppo.errors import ConfigError

PICKLE_PATTERNS = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl"]
OTHER_FORMATS = [
    "*.h5",
    "*.msgpack",
    "*.onnx",
    "*.onnx_data",
    "*.gguf",
    "*.ot",
    "*.tflite",
    "*.mlmodel",
    "onnx/*",
    "openvino/*",
    "coreml/*",
    "original/*",
]
WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]

_downloaded: dict[tuple[str, bool, bool], str] = {}


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _unreachable(field: str, name: str, err: BaseException) -> ConfigError:
    from huggingface_hub import constants

    if constants.is_offline_mode():
        why = "HF_HUB_OFFLINE is set"
    else:
        cause = str(err).splitlines()[0] if str(err) else type(err).__name__
        why = f"{hub_endpoint()}: {cause.removeprefix('Got: ')}"
    return ConfigError(
        field,
        name,
        f"no local folder of this name, and the Hub cannot be reached to download it as a "
        f"Hub model id ({why}); it is not in the local Hub cache either. Give a local model folder, "
        "or download it where the Hub can be reached",
    )


def download_model(repo_id: str, field: str, name: str, allow_pickle: bool = False, weights: bool = True) -> str:
    """The local snapshot folder of Hub model `repo_id` (downloaded on first use); ConfigError naming `field` and
    `name` (the value as given) when it cannot be had. `weights=False`: configs and tokenizer files only."""
    if not is_hub_repo_id(repo_id):
        raise ConfigError(field, name, "is not a valid Hub model id; give ORG/NAME or `hub:ORG/NAME`")
    key = (repo_id, allow_pickle, weights)
    if key in _downloaded and os.path.isdir(_downloaded[key]):
        return _downloaded[key]
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    ignore = (
        OTHER_FORMATS
        + ([] if allow_pickle else PICKLE_PATTERNS)
        + ([] if weights else WEIGHT_PATTERNS + PICKLE_PATTERNS)
    )
    try:
        folder = snapshot_download(repo_id, repo_type="model", ignore_patterns=ignore)
    except GatedRepoError:
        raise ConfigError(
            field,
            name,
            "is a gated Hub model: accept its terms on its Hub page, then log in (`hf auth login` or HF_TOKEN)",
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            field,
            name,
            f"no local folder of this name, and no such model on the Hub "
            f"({hub_endpoint()}; a private model needs `hf auth login` or HF_TOKEN)",
        ) from None
    except LocalEntryNotFoundError as err:
        raise _unreachable(field, name, err) from None
    except (HfHubHTTPError, OSError) as err:
        text = " ".join(str(err).split())[:300]
        raise ConfigError(
            field, name, f"cannot be downloaded from the Hub ({hub_endpoint()}): {type(err).__name__}: {text}"
        ) from None
    _downloaded[key] = folder
    return folder
