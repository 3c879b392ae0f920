"""An exclusive lock on a run folder: one lmppo process writes into an output_dir at a time.

`OUTPUT_DIR/.lmppo.lock` holds the holder's pid, host and start time; the lock itself is an `flock` on that
file, which the kernel releases when the holder exits in any way (SIGKILL included), so a lock file left behind by
a dead process is stale by construction and is taken over. A second `lmppo train` (or `--resume`) into the same
folder is refused with one line naming the holder. The lock is held until the process exits or `release` is
called for every `acquire` (a trainer releases its hold when it is garbage-collected); within one process it is
re-entrant (a trainer, then a resumed trainer, on one folder). On file systems
without `flock` (some network mounts) the lock file still records the holder, and a live holder on this host is
detected by its pid. The process that takes the lock removes the temporaries an earlier, killed process left in
the folder (`lmppo.run.storage.remove_temporaries`): a `.final.tmp-*` model copy, a `.iter-N.tmp` checkpoint, ...
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from typing import Optional

from lmppo.errors import RunLockedError, StorageError
from lmppo.run.layout import LOCK
from lmppo.run.storage import reason, remove_temporaries

LOCK_NAME = LOCK
_held: dict[str, list[int]] = {}  # real path of the folder -> [pid that took it, fd, holders in this process]

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


def _key(output_dir: str) -> str:
    return os.path.realpath(output_dir)


def _holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = json.loads(os.read(fd, 4096).decode("utf-8", "replace") or "{}")
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _wait_for_holder(fd: int, seconds: float = 5.0) -> dict:
    """The holder's record; a holder that has just taken the flock writes it a moment later, so an empty or
    half-written record is read again for up to `seconds`."""
    deadline = time.monotonic() + seconds
    info = _holder(fd)
    while not info and time.monotonic() < deadline:
        time.sleep(0.02)
        info = _holder(fd)
    return info


def _describe(info: dict) -> str:
    if not info:
        return "another process"
    since = info.get("since")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
    return f"process {info.get('pid', '?')} on host {info.get('host', '?')}{when}"


def _pid_alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire(output_dir: str) -> str:
    """Take the lock of run folder `output_dir` (created if missing) for this process; RunLockedError naming the
    holder when another live process has it. Returns the lock file's path."""
    key = _key(output_dir)
    path = os.path.join(key, LOCK_NAME)
    held = _held.get(key)
    if held is not None and held[0] == os.getpid():
        held[2] += 1
        return path
    fd = _locked_fd(output_dir, path)
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()
    try:
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, record)
    except OSError:
        pass  # the flock is what excludes; the record only names the holder
    _held[key] = [os.getpid(), fd, 1]
    remove_temporaries(key)  # left by a killed earlier process: no writer of them is alive now
    return path


def _same_file(fd: int, path: str) -> bool:
    """Whether `fd` is still the file at `path` (a releasing holder removes the lock file: a lock taken on the
    removed file excludes nobody, so it is taken again on the new one)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def _locked_fd(output_dir: str, path: str) -> int:
    """An open file descriptor of the lock file `path`, holding its flock."""
    while True:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise StorageError(f"could not write the run lock {path}: {reason(err, path)}") from None
        _flock(fd, output_dir, path)
        if fcntl is None or _same_file(fd, path):
            return fd
        os.close(fd)


def _flock(fd: int, output_dir: str, path: str) -> None:
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                info = _wait_for_holder(fd)
                os.close(fd)
                raise RunLockedError(
                    f"output_dir {output_dir} is in use by {_describe(info)} (lock file {path}): two runs writing "
                    "into one folder would corrupt it. Wait for that run to finish, or choose another output_dir"
                ) from None
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                os.close(fd)
                raise
    else:  # pragma: no cover
        info = _holder(fd)
        if info.get("host") == socket.gethostname() and info.get("pid") != os.getpid() and _pid_alive(info.get("pid")):
            os.close(fd)
            raise RunLockedError(f"output_dir {output_dir} is in use by {_describe(info)} (lock file {path})")


def release(output_dir: str) -> None:
    """Give up one hold of the lock of `output_dir` (taken by `acquire` in this process); the last one removes the
    lock file and unlocks it (a killed holder leaves it: stale, taken over by the next `acquire`)."""
    key = _key(output_dir)
    held = _held.get(key)
    if held is None or held[0] != os.getpid():
        return
    held[2] -= 1
    if held[2] > 0:
        return
    del _held[key]
    try:
        if fcntl is not None:  # removed while still locked: a process waiting on it tries again on a new file
            try:
                os.unlink(os.path.join(key, LOCK_NAME))
            except OSError:
                pass
            fcntl.flock(held[1], fcntl.LOCK_UN)
    finally:
        os.close(held[1])


def holder(output_dir: str) -> Optional[dict]:
    """The recorded holder of `output_dir`'s lock while some process holds it, else None."""
    path = os.path.join(_key(output_dir), LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        if fcntl is None:  # pragma: no cover
            info = _holder(fd)
            return info if _pid_alive(info.get("pid")) else None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return _holder(fd) or {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
