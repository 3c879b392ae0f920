"""`lmppo push RUN --repo-id ORG/NAME`: upload a run's final model to the Hugging Face Hub.

Built on huggingface_hub's upload API (`HfApi.create_repo`, then `HfApi.upload_folder`): the login is the Hub's
own (`hf auth login` or `HF_TOKEN`), the endpoint `HF_ENDPOINT`. What is uploaded is one folder of `RUN/final/`
with its model card: `policy-merged` when the run has it (a LoRA run: full weights that load without peft), else
`policy`; `--folder` picks another. Any failure (no final model, an invalid id, the Hub unreachable, a refused
token) is one `error:` line; the token never appears in a message.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from lmppo.apps.arguments import PUSH_FOLDERS, push_parser
from lmppo.config import is_hub_repo_id
from lmppo.errors import ConfigError, LmppoError, bounded_repr
from lmppo.run.layout import CONFIG, FINAL, POLICY, POLICY_MERGED
from lmppo.run.model_card import hub_card
from lmppo.run.signals import go_on

FOLDERS = PUSH_FOLDERS


def push_folder(run: str, folder: Optional[str] = None) -> str:
    """The folder `lmppo push RUN` uploads: `RUN/final/<folder>`, by default `policy-merged` when it exists, else
    `policy`; RUN may also be a model folder itself (one holding config.json or adapter_config.json)."""
    if not os.path.isdir(run):
        raise LmppoError(f"lmppo push: RUN {run!r}: no such folder; give a run's output_dir or a model folder")
    final = os.path.join(run, FINAL)
    if os.path.isdir(final):
        if folder is not None:
            path = os.path.join(final, folder)
            if not os.path.isdir(path):
                have = ", ".join(f for f in FOLDERS if os.path.isdir(os.path.join(final, f))) or "none"
                raise LmppoError(f"lmppo push: --folder {folder!r}: {final} has no such folder (it has: {have})")
            return path
        for name in (POLICY_MERGED, POLICY):
            if os.path.isdir(os.path.join(final, name)):
                return os.path.join(final, name)
    if folder is None and any(os.path.isfile(os.path.join(run, f)) for f in ("config.json", "adapter_config.json")):
        return run
    if os.path.isfile(os.path.join(run, CONFIG)):
        raise LmppoError(
            f"lmppo push: {run} is a run without a final model (final/policy): the run did not finish; {go_on(run)}"
        )
    raise LmppoError(
        f"lmppo push: {run} holds neither a run's final model (final/policy) nor a model "
        "(config.json or adapter_config.json)"
    )


def _hub_error(repo_id: str, err: BaseException) -> LmppoError:
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError

    endpoint = constants.ENDPOINT
    if constants.is_offline_mode():
        return LmppoError(f"lmppo push {repo_id}: the Hub cannot be reached (HF_HUB_OFFLINE is set)")
    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, HfHubHTTPError) and status in (401, 403):
        return LmppoError(
            f"lmppo push {repo_id}: the Hub ({endpoint}) refused the upload (HTTP {status}): log in "
            "with `hf auth login` or set HF_TOKEN to a token that can write to this repo"
        )
    text = " ".join(str(err).split())
    if not isinstance(err, HfHubHTTPError):
        return LmppoError(
            f"lmppo push {repo_id}: the Hub cannot be reached ({endpoint}): {type(err).__name__}: "
            f"{bounded_repr(text)[1:-1]}"
        )
    return LmppoError(f"lmppo push {repo_id}: the Hub ({endpoint}) answered HTTP {status}: {bounded_repr(text)[1:-1]}")


def push(
    run: str,
    repo_id: str,
    folder: Optional[str] = None,
    private: Optional[bool] = None,
    commit_message: Optional[str] = None,
    revision: Optional[str] = None,
) -> tuple[str, Any]:
    """Upload the folder `push_folder(run, folder)` to Hub model repo `repo_id` (created if missing);
    (the folder, huggingface_hub's CommitInfo)."""
    if not is_hub_repo_id(repo_id, bare=True):
        raise LmppoError(
            f"lmppo push: --repo-id {repo_id!r} is not a Hub model id; give ORG/NAME (your user name "
            "or an organisation, then the model's name)"
        )
    path = push_folder(run, folder)
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        info = api.create_commit(
            repo_id=repo_id,
            repo_type="model",
            operations=_uploads(path, repo_id),
            revision=revision,
            commit_message=commit_message
            or f"lmppo: {os.path.basename(path)} of {os.path.basename(os.path.abspath(run))}",
        )
    except (OSError, ValueError) as err:  # huggingface_hub's HTTP errors are OSErrors; connection errors too
        raise _hub_error(repo_id, err) from None
    except Exception as err:  # noqa: BLE001 - httpx's connection errors are not OSErrors
        if not type(err).__module__.startswith(("httpx", "httpcore", "huggingface_hub", "requests", "urllib3")):
            raise
        raise _hub_error(repo_id, err) from None
    return path, info


def _uploads(path: str, repo_id: str) -> list:
    """One upload per file of `path`; its model card (README.md) as the Hub shows it (`hub_card`: loaded from
    `repo_id`, a local base folder named by its last part)."""
    from huggingface_hub import CommitOperationAdd

    ops = []
    for top, dirs, names in os.walk(path):
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(top, name)
            rel = os.path.relpath(full, path).replace(os.sep, "/")
            if rel == "README.md":
                with open(full, encoding="utf-8") as fh:
                    card = hub_card(fh.read(), repo_id).encode("utf-8")
                ops.append(CommitOperationAdd(path_in_repo=rel, path_or_fileobj=card))
            else:
                ops.append(CommitOperationAdd(path_in_repo=rel, path_or_fileobj=full))
    return ops


def check_hub_login(repo_id: str, option: str = "push_to_hub") -> None:
    """ConfigError for `option` when no Hub token is known (checked before a run trains, or `lmppo push` sends a
    request, not after)."""
    from huggingface_hub import get_token

    if not get_token():
        later = " (or leave push_to_hub empty and push later with `lmppo push`)" if option == "push_to_hub" else ""
        raise ConfigError(option, repo_id, f"uploading needs a Hub login: run `hf auth login` or set HF_TOKEN{later}")


def push_after_training(output_dir: str, repo_id: str, console: Any = None) -> None:
    """`push_to_hub`: upload the finished run's final model; a failure says the model is safe on disk."""
    try:
        path, info = push(output_dir, repo_id)
    except LmppoError as err:
        raise LmppoError(
            f"{err} (the run finished and its model is in {os.path.join(output_dir, FINAL)}; "
            f"upload it later with `lmppo push {output_dir} --repo-id {repo_id}`)"
        ) from None
    _say(f"pushed {path} to {repo_id}: {getattr(info, 'commit_url', None) or repo_id}", console)


def _say(line: str, console: Any) -> None:
    if console is not None:
        console.print(line, highlight=False, soft_wrap=True)
    else:
        print(line)


def main(argv: Sequence[str], console: Any = None) -> int:
    """`lmppo push`; returns the exit code. Mistakes and Hub failures raise LmppoError (one line from the CLI)."""
    args = push_parser().parse_args(list(argv))
    check_hub_login(args.repo_id, "--repo-id")  # before any request: without a token the Hub would answer 401
    path, info = push(
        args.run,
        args.repo_id,
        folder=args.folder,
        private=args.private,
        commit_message=args.commit_message,
        revision=args.revision,
    )
    url = getattr(info, "commit_url", None) or getattr(info, "repo_url", None) or args.repo_id
    _say(f"pushed {path} to {args.repo_id}: {url}", console)
    return 0
