"""Shared caches filled by one process while the others wait (several ranks, or two runs started together).

``fill_folder(target, build, is_complete)`` / ``fill_file(...)``: when ``is_complete(target)`` is false, take an
exclusive ``fcntl`` lock on a file beside the target (``.<name>.lock``), check again (another process may have
filled it while this one waited), call ``build(tmp)`` on a temporary beside the target and rename it into place.
A reader never sees a half-built target: it is either absent, stale (``is_complete`` false, so the reader waits
for the lock) or whole. Temporaries left by a killed builder are removed by the next one that holds the lock.
Without fcntl (not POSIX) there is no lock; the rename still keeps the cache whole.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from lmppo.errors import LmppoError, write_failure_words

log = logging.getLogger(__name__)


@contextlib.contextmanager
def cache_lock(target: Path, what: str) -> Iterator[None]:
    """Hold the exclusive lock of `target` (a file `.<name>.lock` beside it); says once when it has to wait."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps the cache whole
        yield
        return
    with open(target.parent / f".{target.name}.lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("lmppo: waiting for another process to finish %s (%s)", what, target)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def cache_writes(target: Path, what: str) -> Iterator[None]:
    """A cache folder that cannot be written (read-only, full, no permission) is one LmppoError naming it and how
    to go on, not an OSError from deep inside (`fill_folder`, `fill_file`)."""
    try:
        yield
    except OSError as err:
        words = write_failure_words(err) or f"{type(err).__name__}: {err}"
        raise LmppoError(
            f"cannot write lmppo's cache {target.parent} ({what}): {words}; set LMPPO_CACHE to a writable folder with "
            "room (docs/caches.md)"
        ) from None


def fill_folder(target: Path, build: Callable[[Path], None], is_complete: Callable[[Path], bool], what: str) -> Path:
    """`target`, built by `build(tmp_folder)` unless `is_complete(target)`; one process builds, the others wait.
    LmppoError when the cache cannot be written (`cache_writes`)."""
    if is_complete(target):
        return target
    with cache_writes(target, what):
        return _fill_folder(target, build, is_complete, what)


def _fill_folder(target: Path, build: Callable[[Path], None], is_complete: Callable[[Path], bool], what: str) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    with cache_lock(target, what):
        if is_complete(target):  # another process finished while this one waited
            return target
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # left by a killed builder
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            _make_readable(tmp)
            if target.exists():  # stale: move it aside, swap the new one in, then remove the old one
                old = target.parent / f".{target.name}.tmp-old-{os.getpid()}"
                os.rename(target, old)
                os.rename(tmp, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def fill_file(target: Path, build: Callable[[Path], None], is_complete: Callable[[Path], bool], what: str) -> Path:
    """`target`, written by `build(tmp_file)` unless `is_complete(target)`; one process writes, the others wait.
    LmppoError when the cache cannot be written (`cache_writes`)."""
    if is_complete(target):
        return target
    with cache_writes(target, what):
        return _fill_file(target, build, is_complete, what)


def _fill_file(target: Path, build: Callable[[Path], None], is_complete: Callable[[Path], bool], what: str) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    with cache_lock(target, what):
        if is_complete(target):
            return target
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            with contextlib.suppress(OSError):
                stale.unlink()
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
        try:
            build(tmp)
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    return target


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a private folder; give the cache the permissions the umask allows, like any other file."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)
