"""Which files of a run folder lmppo wrote: it removes or replaces those and nothing else.

Design notes: docs/design.md, `lmppo.run.ownership`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings

import lmppo.run.storage as storage
from lmppo.run.config_file import is_run_config
from lmppo.run.layout import (
    ARTIFACTS,
    CHECKPOINT_ENTRY,
    CHECKPOINT_NAME,
    CHECKPOINTS,
    CONFIG,
    FINAL,
    FINAL_FOLDERS,
    MANIFEST,
    OWNED,
    TENSORBOARD,
)

"""Names a run writes at the top of its output_dir (besides the lock file and this record)."""


def _record(output_dir: str) -> dict:
    try:
        with open(os.path.join(output_dir, OWNED), encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_record(output_dir: str, data: dict) -> None:
    storage.write_json(os.path.join(output_dir, OWNED), data, f"the ownership record ({OWNED})", indent=1)


def recorded(output_dir: str) -> set[str] | None:
    """Names in the ownership record, None when there is no readable record."""
    names = _record(output_dir).get("files")
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else None


def _looks_own(output_dir: str, name: str) -> bool:
    """For a folder without a record: does `name` have the shape of what lmppo writes?"""
    path = os.path.join(output_dir, name)
    own_config = is_run_config(os.path.join(output_dir, CONFIG))
    try:
        if name == CHECKPOINTS:
            return os.path.isdir(path) and all(CHECKPOINT_ENTRY.match(e) for e in os.listdir(path))
        if name == FINAL:
            entries = set(os.listdir(path)) if os.path.isdir(path) else None
            return entries is not None and entries <= set(FINAL_FOLDERS)
    except OSError:
        return False
    if name == CONFIG:
        return own_config
    return False  # a file at the top (metrics.jsonl, ...) is lmppo's only when a record names it


def survey(output_dir: str) -> tuple[list[str], list[str]]:
    """(lmppo's own, foreign) names among the run artifacts present in `output_dir`. An own config.yaml alone
    (a run that stopped before writing anything else) is not listed."""
    present = [n for n in ARTIFACTS if os.path.lexists(os.path.join(output_dir, n)) and not _empty_dir(output_dir, n)]
    mine = recorded(output_dir)
    own: list[str] = []
    foreign: list[str] = []
    for name in present:
        is_own = name in mine if mine is not None else _looks_own(output_dir, name)
        if name == CONFIG and not is_own and is_run_config(os.path.join(output_dir, name)):
            is_own = True  # lmppo's header: written by some lmppo run
        (own if is_own else foreign).append(name)
    if own == [CONFIG]:
        own = []
    return own, foreign


def _empty_dir(output_dir: str, name: str) -> bool:
    """An empty folder, or a link to one (`checkpoints` linked to a bigger disk before the first run): holds nothing
    of anyone's, so a run may use it."""
    path = os.path.join(output_dir, name)
    try:
        return os.path.isdir(path) and not os.listdir(path)
    except OSError:
        return False


def claim(output_dir: str) -> None:
    """Record the artifact names that are free (or already ours) as this run's."""
    mine = recorded(output_dir) or set()
    names = sorted(
        n
        for n in ARTIFACTS
        if n in mine
        or not os.path.lexists(os.path.join(output_dir, n))
        or _empty_dir(output_dir, n)
        or (n == CONFIG and is_run_config(os.path.join(output_dir, n)))
    )
    _write_record(output_dir, {**_record(output_dir), "files": names})  # (`inside` kept: what final/ holds of ours)


def _files(folder: str) -> list[str]:
    """Every file below `folder`, as `a/b` paths relative to it (links not followed)."""
    out = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names) + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            out.append(os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/"))
    return out


def write_listing(folder: str, files: list[str] | None = None) -> None:
    """Record `files` (default: every file below `folder` now) as the ones lmppo wrote in its run folder's
    `folder` (`inside` in the ownership record); nothing where the parent is not a run folder with a record."""
    parent, name = os.path.split(os.path.normpath(os.path.abspath(folder)))
    data = _record(parent)
    if "files" in data:
        inside = data.get("inside")
        inside = inside if isinstance(inside, dict) else {}
        _write_record(parent, {**data, "inside": {**inside, name: _files(folder) if files is None else files}})


def _listing(folder: str) -> set[str] | None:
    parent, name = os.path.split(os.path.normpath(os.path.abspath(folder)))
    inside = _record(parent).get("inside")
    files = inside.get(name) if isinstance(inside, dict) else None
    return {f for f in files if isinstance(f, str)} if isinstance(files, list) else None


def _manifest_files(checkpoint: str) -> set[str] | None:
    try:
        with open(os.path.join(checkpoint, MANIFEST), encoding="utf-8") as fh:
            files = json.load(fh).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return set(files) | {MANIFEST} if isinstance(files, dict) else None


def own_files(folder: str) -> set[str] | None:
    """The files lmppo wrote below its folder `folder` (`a/b` paths) as its records name them, None when no record
    lists them (a `final/` of an lmppo version without listings: none is taken as lmppo's)."""
    name = os.path.basename(os.path.normpath(folder))
    if name == CHECKPOINTS:
        own: set[str] = set()
        for entry in os.listdir(folder) if os.path.isdir(folder) else []:
            if not CHECKPOINT_ENTRY.match(entry):
                continue
            path = os.path.join(folder, entry)
            listed = _manifest_files(path) if CHECKPOINT_NAME.match(entry) else None
            inside = _files(path) if os.path.isdir(path) else [""]
            own |= {f"{entry}/{f}".rstrip("/") for f in inside if listed is None or f in listed}
        return own
    if CHECKPOINT_NAME.match(name):
        return _manifest_files(folder)
    if name == TENSORBOARD:
        return {f for f in _files(folder) if os.path.basename(f).startswith("events.out.tfevents.")}
    return _listing(folder)


def foreign_files(folder: str) -> list[str]:
    """The files below lmppo's folder `folder` (a link to a folder is followed) that no record of lmppo names
    (`own_files`): where no record lists the folder's files (a `final/` of an older lmppo), all of them."""
    if not os.path.isdir(folder):
        return []
    own = own_files(folder) or set()
    return [f for f in _files(folder) if f not in own]


def _link(src: str, dst: str) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:  # a file system without hard links: a copy (the original stays until the old folder goes)
        shutil.copy2(src, dst, follow_symlinks=False)


def keep_foreign(old: str, new: str, foreign: list[str] | None = None) -> list[str]:
    """Hard-link the files of folder `old` that lmppo did not write (`foreign`, default `foreign_files(old)`) into
    folder `new`, which is about to replace it, at the same place (a name lmppo now writes itself: `NAME.yours`);
    returns them."""
    foreign = foreign_files(old) if foreign is None else foreign
    for rel in foreign:
        dst = os.path.join(new, *rel.split("/"))
        _link(os.path.join(old, *rel.split("/")), dst + ".yours" if os.path.lexists(dst) else dst)
    return foreign


def publishing(tmp: str, final_path: str) -> None:
    """Before folder `tmp` replaces lmppo's folder `final_path` (`storage.atomic_dir(before_publish=...)`): its
    files are listed as lmppo's, and the old folder's files lmppo did not write are kept (`keep_foreign`)."""
    foreign = foreign_files(final_path)  # before the new listing: an old file of a name lmppo writes again, which no
    # record names (a final/ of an older lmppo), is kept as `NAME.yours`, not taken for lmppo's
    write_listing(final_path, _files(tmp))  # then: a kill before the rename keeps too much, never too little
    if foreign:
        announce_kept(final_path, keep_foreign(final_path, tmp, foreign))


def announce_kept(where: str, kept: list[str]) -> None:
    if kept:
        more = f" and {len(kept) - 5} more" if len(kept) > 5 else ""
        names = ", ".join(os.path.join(where, f) for f in kept[:5])
        warnings.warn(f"kept {len(kept)} file(s) lmppo did not write: {names}{more}", stacklevel=3)


def remove_keeping(path: str, what: str) -> list[str]:
    """Remove lmppo's folder `path` except the files it did not write, which stay where they are (the folder is
    replaced by one holding only them, atomically); returns those kept."""
    foreign = foreign_files(path)
    if not foreign:
        storage.remove_tree(path, what)
        return []
    tmp = storage.temp_name(path)
    with storage.writing(f"(removing) {what}", path):
        os.makedirs(tmp)
        try:
            keep_foreign(path, tmp, foreign)
            if _listing(path) is not None:
                write_listing(path, [])  # lmppo owns nothing left here
            storage.publish(tmp, path)
        except BaseException:
            storage.discard(tmp)
            raise
    return foreign


def clear_linked(link: str, what: str) -> list[str]:
    """Remove lmppo's files below the folder that `link` points to (a run sub-folder on another disk); the link,
    its target and the files lmppo did not write stay. Returns those kept."""
    foreign = foreign_files(link)
    keep = set(foreign)
    emptied = set()
    for rel in _files(link):
        if rel in keep:
            continue
        with storage.writing(f"(removing) {what}/{rel}", link):
            with storage.uninterrupted():
                path = os.path.join(link, *rel.split("/"))
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
        parent = os.path.dirname(rel)
        while parent:
            emptied.add(parent)
            parent = os.path.dirname(parent)
    for rel in sorted(emptied, key=lambda r: -r.count("/")):  # deepest first; a folder with a kept file stays
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(link, *rel.split("/")))
    return foreign


def remove_own(output_dir: str, names: list[str]) -> None:
    """Remove lmppo's own artifacts `names` (each renamed aside first, then deleted); files lmppo did not write
    inside its folders are kept where they are (`remove_keeping`), with one warning naming them."""
    kept = []
    for name in names:
        path = os.path.join(output_dir, name)
        if name == CONFIG:
            continue  # replaced by the new run's
        if os.path.islink(path) and os.path.isdir(path):  # on another disk: followed and kept, not replaced
            kept += [f"{name}/{f}" for f in clear_linked(path, name)]
        elif os.path.isdir(path):
            kept += [f"{name}/{f}" for f in remove_keeping(path, name)]
        else:
            with storage.writing(f"(removing) {name}", path):
                os.unlink(path)
    announce_kept(output_dir, kept)
