"""The result of a command that works for a while and then writes (`lmppo eval`, `lmppo merge`):
checked writable before the work, written by one process at a time, and no temporary of an earlier, killed run of
the same command left beside it.

    with result_output(out, "the evaluation", "`lmppo eval`", run_dir=run):  # refused now if out cannot be written
        ...work...
        storage.write_json(out, result, ...)

Into a run folder (`run_dir`) it takes the run's lock (`lmppo.run.lock`: no training writes there meanwhile, and the
lock removes what a killed process left); elsewhere an exclusive lock file beside the result, `.NAME.lock`, removed
at the end, and the temporaries of that name (`.NAME.tmp-*`, `.NAME.old-*`, `.NAME.del-*`) are removed first.
"""

from __future__ import annotations

import errno
import os
import re
from contextlib import contextmanager
from typing import Iterator, Optional

import lmppo.run.lock as lock
import lmppo.run.storage as storage
from lmppo.errors import RunLockedError, StorageError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


def _existing_folder(path: str) -> str:
    """The folder a new `path` will be created in: its nearest existing ancestor."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return folder


def check_writable(path: str, what: str) -> None:
    """StorageError naming `what`, `path` and why, when a file or folder cannot be created at `path` (a read-only
    file system, no permission, a full disk): a real probe file is created and removed in the folder that will
    hold it (or its nearest existing parent)."""
    folder = _existing_folder(path)
    probe = storage.temp_name(os.path.join(folder, "lmppo-write-probe"))
    try:
        with storage.uninterrupted():
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, b"x")
            finally:
                os.close(fd)
                os.unlink(probe)
    except OSError as err:
        raise StorageError(
            f"cannot write {what} to {path}: {storage.reason(err, folder)} ({folder}); nothing was done: "
            "give another output path or make it writable"
        ) from None


def remove_stale(path: str) -> list[str]:
    """Remove the temporaries of `path` an earlier, killed writer left beside it (`.NAME.tmp-XXXXXXXX`, `.old-`,
    `.del-`); call only while holding the lock of `path`. Returns them."""
    parent, name = os.path.split(os.path.abspath(path))
    pattern = re.compile(rf"^\.{re.escape(name)}\.(tmp|old|del)-[0-9a-f]{{8}}$")
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return []
    stale = [os.path.join(parent, n) for n in names if pattern.match(n)]
    for left in stale:
        storage.discard(left)
    return stale


@contextmanager
def _lock_beside(path: str, command: str) -> Iterator[None]:
    parent, name = os.path.split(os.path.abspath(path))
    lock_path = os.path.join(parent, f".{name}.lock")
    os.makedirs(parent, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RunLockedError(
                        f"{path} is being written by another {command} (lock file {lock_path}); wait for it to end"
                    ) from None
                raise
        try:
            yield
        finally:
            with storage.uninterrupted():
                try:
                    os.unlink(lock_path)
                except OSError:
                    pass
    finally:
        os.close(fd)


@contextmanager
def result_output(path: str, what: str, command: str, run_dir: Optional[str] = None) -> Iterator[None]:
    """Hold the right to write `what` at `path` for the block (see the module docstring): StorageError before the
    block when it cannot be written, RunLockedError when another process writes it (a training in `run_dir`, or
    another `command` writing `path`)."""
    check_writable(path, what)
    if run_dir is not None:
        try:
            lock.acquire(run_dir)
        except RunLockedError as err:  # the lock's own advice is about training into another output_dir
            holder = str(err).split(" is in use by ", 1)[-1].split(" (lock file", 1)[0]
            raise RunLockedError(
                f"{command} writes {path}, but the run {run_dir} is in use by {holder}; wait for it to end, or give "
                "another output path"
            ) from None
        try:
            remove_stale(path)
            yield
        finally:
            lock.release(run_dir)
        return
    with _lock_beside(path, command):
        remove_stale(path)
        yield
