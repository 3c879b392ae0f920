"""The run folder (`output_dir`): its layout, creating it without clobbering another run, finding its checkpoints,
and cutting its logs back to a checkpoint. The layout is drawn in docs/checkpoints.md."""

from __future__ import annotations

import json
import os
from typing import Callable, Optional, Sequence

import lmppo.run.lock as lock
import lmppo.run.metrics_file as metrics_file
import lmppo.run.ownership as ownership
import lmppo.run.signals as signals
import lmppo.run.storage as storage
from lmppo.config import Config, RewardModelConfig
from lmppo.errors import ConfigError
from lmppo.run.config_file import write_run_config
from lmppo.run.layout import CHECKPOINT_NAME, CHECKPOINTS, CONFIG, MANIFEST, METRICS, SAMPLES, STATE


def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, CHECKPOINTS)


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(iteration, folder) of every published checkpoint folder, newest first (not yet verified)."""
    root = checkpoints_dir(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = CHECKPOINT_NAME.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found, reverse=True)


def checkpoint_folder_run(path: str) -> Optional[str]:
    """The run folder of `path` when `path` is a checkpoint folder (`RUN/checkpoints/iter-N`), else None."""
    norm = os.path.normpath(os.path.abspath(path))
    parent = os.path.dirname(norm)
    if os.path.basename(parent) == CHECKPOINTS and (
        CHECKPOINT_NAME.match(os.path.basename(norm)) or os.path.isfile(os.path.join(norm, MANIFEST))
    ):
        return os.path.dirname(parent)
    if os.path.isfile(os.path.join(norm, MANIFEST)) and os.path.isfile(os.path.join(norm, STATE)):
        return parent
    return None


def os_reason(err: BaseException, where: str = "") -> str:
    """Why a write failed (`lmppo.run.storage.reason`), with the file when the error names one."""
    filename = getattr(err, "filename", None)
    return storage.reason(err, filename or where) + (f" ({filename})" if filename else "")


RESUME_COMMAND = "lmppo train --resume"
"""How a run folder is continued, by default (`lmppo reward-model --resume` continues a reward-model run)."""


def prepare_output_dir(
    cfg: Config | RewardModelConfig,
    is_main_process: bool = True,
    resuming: bool = False,
    comments: Sequence[str] = (),
    resume_command: str = RESUME_COMMAND,
) -> None:
    """Create `cfg.output_dir` and write its config.yaml (secrets masked); `resume_command` continues the run.

    A folder that already holds a run is refused unless `overwrite: true`, which removes that run's files first
    (only lmppo's own: metrics, samples, checkpoints, final, tensorboard). A folder holding only a config.yaml
    lmppo wrote (a run that stopped before its first iteration) is reused. `resuming`: the folder is the run
    being continued; nothing is removed."""
    out = cfg.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError("output_dir", out, "is a file; give a folder for the run's metrics and checkpoints")
    if is_main_process:  # one process per run folder (lmppo.run.lock); taken before anything in it is read or changed
        lock.acquire(out)
    try:
        _prepare_locked(cfg, out, is_main_process, resuming, comments, resume_command)
    except BaseException:
        if is_main_process:
            lock.release(out)
        raise


def _prepare_locked(
    cfg: Config | RewardModelConfig,
    out: str,
    is_main_process: bool,
    resuming: bool,
    comments: Sequence[str],
    resume_command: str,
) -> None:
    own, foreign = ownership.survey(out) if os.path.isdir(out) else ([], [])
    if foreign and not resuming:
        raise ConfigError(
            "output_dir",
            out,
            f"holds files lmppo did not write ({', '.join(foreign)}); a run would "
            "write over them, so lmppo neither uses nor removes them: choose another output_dir or "
            "move them away",
        )
    if own and not resuming:
        if not cfg.overwrite:
            raise ConfigError(
                "output_dir",
                out,
                f"already holds a run ({', '.join(own)}); choose another folder, "
                + (f"continue it with `{resume_command} {out}`, " if signals.has_checkpoint(out) else "")
                + "or set overwrite: true (`--overwrite true`: removes those files of the old run, nothing else)",
            )
        if is_main_process:
            ownership.remove_own(out, own)
    if is_main_process:
        try:
            os.makedirs(out, exist_ok=True)
            if not resuming:
                ownership.claim(out)
            resume_with = "" if resume_command == RESUME_COMMAND else f"{resume_command} OUTPUT_DIR"
            write_run_config(cfg, os.path.join(out, CONFIG), comments, resume_with)
        except OSError as err:
            raise ConfigError("output_dir", out, f"cannot be written: {os_reason(err, out)}") from None


def _truncate_jsonl(path: str, keep: Callable[[dict], bool]) -> None:
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8", errors="replace") as fh:
        lines = fh.read().split("\n")
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # blank, or torn by a kill in the middle of a write
        if isinstance(row, dict) and keep(row):
            kept.append(line)
    text = "".join(line + "\n" for line in kept)
    storage.write_text(path, text, f"{os.path.basename(path)} (cut back to the checkpoint)")


def truncate_logs(output_dir: str, iteration: int, episode: int) -> None:
    """Cut metrics.jsonl back to iterations <= `iteration` and samples.jsonl to episodes <= `episode`."""
    metrics_file.warn_lost(output_dir, iteration)  # a file cut by hand: said once, not silently

    def upto(key: str, limit: int) -> Callable[[dict], bool]:
        def keep(row: dict) -> bool:
            value = row.get(key)
            return isinstance(value, (int, float)) and value <= limit

        return keep

    _truncate_jsonl(os.path.join(output_dir, METRICS), upto("iteration", iteration))
    _truncate_jsonl(os.path.join(output_dir, SAMPLES), upto("episode", episode))
