"""A checkpoint's manifest.json: what makes a checkpoint folder complete and intact (docs/checkpoints.md).

Written last into the temporary folder, it lists the size and sha256 of every other file; a checkpoint whose
manifest is missing, unreadable or does not match is skipped and the one before it is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from typing import Optional

import lmppo.run.ownership as ownership
import lmppo.run.storage as storage
from lmppo.distributed.zero import ENGINE_TAG
from lmppo.errors import CheckpointError, LmppoError
from lmppo.run.folder import checkpoints_dir, list_checkpoints
from lmppo.run.layout import (
    CHECKPOINT_NAME,
    CHECKPOINTS,
    MANIFEST,
    REQUIRED_FILES,
    STATE,
    is_checkpoint_leftover,
    rng_files,
)

FORMAT = 1
"""Version of the checkpoint layout; bumped when it changes incompatibly."""


def write_json(path: str, obj: object) -> None:
    """`obj` as JSON into `path`, flushed to disk (inside a checkpoint's temporary folder)."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1, allow_nan=True)
        fh.flush()
        os.fsync(fh.fileno())


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def required_files(manifest: dict) -> list[str]:
    """What manifest `manifest` must list: state.json and, for whole tensors, the weights and the optimizer;
    for a sharded layout, every process's RNG files and DeepSpeed optimizer shard."""
    layout = manifest.get("layout") or {}
    if not layout.get("deepspeed_stage"):
        return list(REQUIRED_FILES)
    processes = manifest.get("processes")
    if not isinstance(processes, int) or processes < 1:
        return [STATE, "(the number of processes)"]
    files = [STATE]
    for rank in range(processes):
        files += rng_files(rank)
    return files


def _has_shard(files: dict, rank: int) -> bool:
    return any(
        name.startswith(ENGINE_TAG + "/") and f"zero_pp_rank_{rank}_" in name and name.endswith("optim_states.pt")
        for name in files
    )


def verify_checkpoint(path: str) -> dict:
    """The manifest of checkpoint folder `path` after checking every file it lists (size and sha256);
    CheckpointError saying what is wrong otherwise."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST} (its write did not finish)")
    try:
        with open(mpath, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({err})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not a lmppo checkpoint manifest of format {FORMAT}")
    missing = [f for f in required_files(manifest) if f not in files]
    if (manifest.get("layout") or {}).get("deepspeed_stage"):
        missing += [
            f"{ENGINE_TAG}/ optimizer shard of process {r}"
            for r in range(manifest.get("processes") or 0)
            if not _has_shard(files, r)
        ]
    if missing:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} does not list {', '.join(missing)}")
    for name, info in files.items():
        parts = name.split("/") if isinstance(name, str) else [""]
        if (
            name in (MANIFEST, "")
            or os.path.isabs(name)
            or any(part in ("", ".", "..") for part in parts)
            or "\\" in name
        ):
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} lists a file outside the folder: {name!r}")
        fpath = os.path.join(path, *parts)
        if not isinstance(info, dict) or not os.path.isfile(fpath):
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        if os.path.getsize(fpath) != info.get("bytes"):
            raise CheckpointError(
                f"checkpoint {path}: {name} has {os.path.getsize(fpath)} bytes, the manifest "
                f"says {info.get('bytes')} (truncated or changed)"
            )
        if _sha256(fpath) != info.get("sha256"):
            raise CheckpointError(f"checkpoint {path}: {name} does not match its sha256 in the manifest (corrupt)")
    return manifest


def write_manifest(folder: str, iteration: int, processes: int = 1, layout: Optional[dict] = None) -> None:
    """manifest.json of `folder`: format, iteration, number of processes, layout (`Strategy.checkpoint_layout`),
    size and sha256 of every other file (sub-folders included, as `a/b`). Written last."""
    files = {}
    for top, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(top, name)
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            if rel != MANIFEST:
                files[rel] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    write_json(
        os.path.join(folder, MANIFEST),
        {"format": FORMAT, "iteration": iteration, "processes": processes, "layout": layout or {}, "files": files},
    )


def latest_checkpoint(output_dir: str) -> Optional[str]:
    """The newest checkpoint of the run in `output_dir` that verifies; ones that do not are skipped with a
    warning. None when there is none."""
    for _iteration, path in list_checkpoints(output_dir):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as err:
            warnings.warn(f"skipping a checkpoint: {err}; trying the one before it", stacklevel=2)
    return None


def resolve_checkpoint(path: str) -> str:
    """`path` if it is a checkpoint folder (verified), else the latest verified checkpoint of run folder `path`."""
    if os.path.isfile(os.path.join(path, MANIFEST)) or CHECKPOINT_NAME.match(os.path.basename(os.path.normpath(path))):
        verify_checkpoint(path)
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"cannot resume from {path}: no such folder")
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(no_checkpoint_diagnosis(path))
    return found


def no_checkpoint_diagnosis(output_dir: str) -> str:
    """Why run folder `output_dir` cannot be resumed: no checkpoint was ever published, or none verifies (and
    why each does not). Never advises a step that deletes something without saying what it deletes."""
    published = list_checkpoints(output_dir)
    if published:
        reasons = []
        for _i, p in published[:3]:
            try:
                verify_checkpoint(p)
            except CheckpointError as err:
                reasons.append(str(err).replace(f"checkpoint {p}", os.path.basename(p)).replace(p, os.path.basename(p)))
        more = f"; and {len(published) - 3} more" if len(published) > 3 else ""
        return (
            f"cannot resume from {output_dir}: none of its {len(published)} checkpoints verifies "
            f"({'; '.join(reasons)}{more}). Nothing was changed: they are kept as they are for inspection "
            "(a disk or copy problem?)"
        )
    own, _foreign = ownership.survey(output_dir) if os.path.isdir(output_dir) else ([], [])
    removes = f" (which removes {', '.join(own)} of that run)" if own else ""
    return (
        f"cannot resume from {output_dir}: it holds no complete checkpoint ({CHECKPOINTS}/iter-N/{MANIFEST}); "
        f"the run stopped before its first checkpoint (checkpoint.every sets how often one is written). Start "
        f"it again with overwrite: true (`--overwrite true`){removes}, or in another output_dir"
    )


def prune_checkpoints(output_dir: str, keep_last: int, newest: str) -> None:
    """Keep the `keep_last` newest checkpoints up to `newest`; remove older ones and leftovers of killed writes."""
    root = checkpoints_dir(output_dir)
    kept = 0
    for _iteration, path in list_checkpoints(output_dir):
        if kept == 0 and os.path.abspath(path) != os.path.abspath(newest):
            continue  # newer than the one just written: left for inspection (see resume_trainer)
        kept += 1
        if kept > keep_last and not ownership.foreign_files(path):  # (one with a file of yours inside is kept)
            with contextlib.suppress(LmppoError):  # renamed aside first: a kill never leaves a half-removed iter-N
                storage.remove_tree(path, f"the old checkpoint {os.path.basename(path)}")
    for name in os.listdir(root):
        if is_checkpoint_leftover(name):
            storage.discard(os.path.join(root, name))
