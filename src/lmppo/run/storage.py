"""One write layer for a run's state: every file lmppo writes into a run folder goes through here.

What it guarantees, whatever the writer (Python's `open`, `torch.save`, safetensors, `save_pretrained`, ...):

- a failure of the real writer (`OSError`, torch's `RuntimeError` on a full disk, safetensors' `SafetensorError`,
  a file-size limit) becomes one `StorageError` naming what was being written, where, and why (the disk is
  full, the folder is read-only, it does not exist, ...);
- files and folders are written under a temporary name and renamed, so the previous complete version stays
  loadable, and the temporary files of a failed write are removed;
- appends (`metrics.jsonl`, `samples.jsonl`) are line-atomic: a line that could not be written whole is cut off
  again, and a torn last line left by a kill is cut off before the next append.

It imports only the standard library and lmppo.errors (torch and safetensors errors are recognised by name).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import uuid
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, TypedDict

from lmppo.errors import LmppoError, StorageError, write_failure_words
from lmppo.run.layout import CHECKPOINT_TEMPORARY, LINKABLE_FOLDERS

try:
    import resource
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]


def _free_bytes(path: str) -> int | None:
    """Free bytes on the file system holding `path` (its nearest existing parent), None when unknown."""
    path = os.path.abspath(path)
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def _size_limited() -> bool:
    """Whether this process runs under a file-size limit (`ulimit -f`)."""
    if resource is None:  # pragma: no cover - Windows
        return False
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return soft != resource.RLIM_INFINITY


def reason(err: BaseException, where: str = "") -> str:
    """Why a write failed, in words: the errno of an OSError, else what the message of torch / safetensors says,
    else (a writer that hides the cause) the state of the disk."""
    words = write_failure_words(err)
    if words is not None:
        return words
    text = str(err)
    free = _free_bytes(where) if where else None
    if free is not None and free < (1 << 20):
        return f"the disk is full ({free} bytes free)"
    if _size_limited() and ("file write failed" in text or "enforce fail" in text):  # torch hides EFBIG too
        return "the file is larger than this process may write (file size limit: ulimit -f)"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return _short(f"{type(err).__name__}: {text}")


def _short(text: str, n: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + " ..."


def is_write_failure(err: BaseException) -> bool:
    """An exception a writer raises when the bytes did not reach the disk (not lmppo's own errors)."""
    if isinstance(err, LmppoError):
        return False
    if isinstance(err, OSError):
        return True
    name = type(err).__name__
    return name == "SafetensorError" or isinstance(err, RuntimeError)


def failure(what: str, where: str, err: BaseException, keep: str = "") -> StorageError:
    return StorageError(f"could not write {what} to {where}: {reason(err, where)}" + (f"; {keep}" if keep else ""))


@contextmanager
def writing(what: str, where: str, keep: str = "") -> Iterator[None]:
    """Turn a failure of the real writer inside the block into one StorageError naming `what` and `where`;
    `keep`: what is still intact (added to the message)."""
    try:
        yield
    except BaseException as err:
        if is_write_failure(err):
            raise failure(what, where, err, keep) from err
        raise


class _Section(TypedDict):
    depth: int  # steps under way (nested)
    deferred: Optional[BaseException]  # a signal's exception, raised when the last step ends


_section: _Section = {"depth": 0, "deferred": None}


@contextmanager
def uninterrupted() -> Iterator[None]:
    """A step a signal must not cut in two (renames, removals): a handler that finds one under way (`interruptible`
    is False) hands its exception to `defer`, and it is raised when the step ends."""
    _section["depth"] += 1
    try:
        yield
    finally:
        _section["depth"] -= 1
        if _section["depth"] == 0 and _section["deferred"] is not None:
            exc, _section["deferred"] = _section["deferred"], None
            raise exc


def interruptible() -> bool:
    return _section["depth"] == 0


def defer(exc: BaseException) -> None:
    _section["deferred"] = exc


def _remove(path: str) -> None:
    with uninterrupted():
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass


def discard(path: str) -> None:
    """Remove file or folder `path` if it exists (a temporary), not cut short by a signal."""
    _remove(path)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def temp_name(path: str, kind: str = "tmp") -> str:
    """A hidden name beside `path` that no other writer uses: `.NAME.tmp-XXXXXXXX`."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}.{kind}-{uuid.uuid4().hex[:8]}")


_TEMPORARY = re.compile(rf"^\..+\.(tmp|old|del)-[0-9a-f]{{8}}$|{CHECKPOINT_TEMPORARY.pattern}|^.+\.tmp-\d+\.png$")
"""Names lmppo gives its temporaries: `temp_name`'s `.NAME.tmp-XXXXXXXX` (`.old-`, `.del-`), the checkpoint
writer's `.iter-N.tmp` and the plot's `NAME.tmp-PID.png`. A user's own `notes.tmp` does not match."""


_OLD = re.compile(r"^\.(.+)\.old-[0-9a-f]{8}$")
_DEPTH = 4
"""How deep below a run folder lmppo writes (`final/policy/.README.md.tmp-*` is 3): no deeper walk (an output_dir
of `.` would otherwise walk all below it)."""


def temporaries(folder: str) -> list[str]:
    """Every temporary lmppo made below `folder` (`_TEMPORARY`), outermost only: none is left after a write that
    finished or failed, only after a kill (SIGKILL, power loss) or a signal during the clean-up itself. Below a
    linked run sub-folder (`LINKABLE_FOLDERS`), and beside the target of a linked `final/` (where it writes)."""
    left = _temporaries_below(folder)
    for name in LINKABLE_FOLDERS:
        link = os.path.join(folder, name)
        if os.path.islink(link) and os.path.isdir(link):
            left += _temporaries_below(link)
            target = os.path.realpath(link)
            beside = re.compile(rf"^\.{re.escape(os.path.basename(target))}\.(tmp|old|del)-[0-9a-f]{{8}}$")
            parent = os.path.dirname(target)
            with contextlib.suppress(OSError):
                left += [os.path.join(parent, n) for n in sorted(os.listdir(parent)) if beside.match(n)]
    return left


def _temporaries_below(folder: str) -> list[str]:
    left = []
    top = os.path.abspath(folder).rstrip(os.sep).count(os.sep)
    for root, dirs, files in os.walk(folder):
        for name in sorted(dirs + files):
            if _TEMPORARY.match(name):
                left.append(os.path.join(root, name))
        deep = os.path.abspath(root).count(os.sep) - top >= _DEPTH - 1
        dirs[:] = [] if deep else [d for d in dirs if not _TEMPORARY.match(d)]  # (not inside one: it goes whole)
    return left


def remove_temporaries(folder: str) -> list[str]:
    """Remove every temporary of an earlier process below run folder `folder` (`temporaries`); returns them.
    Called by the process that takes the run lock (`lmppo.run.lock.acquire`), so no writer of them is alive."""
    left = temporaries(folder)
    for path in left:
        parent, name = os.path.split(path)
        old = _OLD.match(name)
        if old and not os.path.lexists(os.path.join(parent, old.group(1))):  # killed between publish's renames
            with contextlib.suppress(OSError):
                os.rename(path, os.path.join(parent, old.group(1)))  # the complete older version comes back
                continue
        _remove(path)
    return left


def publish(tmp: str, final_path: str) -> None:
    """Flush folder or file `tmp` and rename it to `final_path`, replacing an older one of that name (the older
    one is renamed aside first, so some complete version exists under a known name at every moment)."""
    parent = os.path.dirname(os.path.abspath(final_path))
    if os.path.isdir(tmp):
        fsync_tree(tmp)
    with uninterrupted():  # a signal waits: the two renames are one step
        if os.path.isdir(final_path):
            old = temp_name(final_path, "old")
            os.rename(final_path, old)
            os.rename(tmp, final_path)
            _remove(old)
        else:
            os.replace(tmp, final_path)
    fsync_dir(parent)


@contextmanager
def atomic_dir(
    final_path: str, what: str = "", keep: str = "", before_publish: Callable[[str, str], None] | None = None
) -> Iterator[str]:
    """Yield a temporary folder beside `final_path`; on success flush it and rename it to `final_path`. On any
    failure the temporary folder is removed and an existing `final_path` is untouched; a writer failure
    becomes a StorageError (when `what` is given). `before_publish(tmp, final_path)`: called just before the
    rename (`lmppo.run.ownership.publishing` keeps the files lmppo did not write)."""
    named = final_path
    if os.path.islink(final_path) and os.path.isdir(final_path):  # a link to a folder on another disk stays a link:
        final_path = os.path.realpath(final_path)  # the new folder is written beside its target and replaces that
    parent = os.path.dirname(os.path.abspath(final_path))
    tmp = temp_name(final_path)
    try:
        with writing(what or f"the folder {os.path.basename(final_path)}", final_path, keep):
            os.makedirs(parent, exist_ok=True)
            os.makedirs(tmp)
            yield tmp
            if before_publish is not None:
                before_publish(tmp, named)
            publish(tmp, final_path)
    except BaseException:
        _remove(tmp)
        raise


@contextmanager
def atomic_file(path: str, what: str, keep: str = "") -> Iterator[str]:
    """Yield a temporary file name beside `path`; on success it is flushed and renamed to `path`."""
    tmp = temp_name(path)
    try:
        with writing(what, path, keep):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            yield tmp
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            fsync_dir(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        _remove(tmp)
        raise


def write_text(path: str, text: str, what: str, keep: str = "") -> None:
    """`path` holds `text` (UTF-8), written atomically."""
    with atomic_file(path, what, keep) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()


def write_json(
    path: str,
    obj: object,
    what: str,
    keep: str = "",
    indent: Optional[int] = None,
    default: Optional[Callable[[object], object]] = None,
) -> None:
    """`path` holds `obj` as JSON, written atomically (serialised first: a value JSON cannot hold writes nothing);
    `indent`, `default`: as json.dumps."""
    write_text(path, json.dumps(obj, indent=indent, default=default), what, keep)


def _cut_torn_tail(fd: int, size: int) -> int:
    """Cut a last line without its newline (left by a kill mid-append); returns the new size."""
    if size == 0:
        return 0
    os.lseek(fd, size - 1, os.SEEK_SET)
    if os.read(fd, 1) == b"\n":
        return size
    back = min(size, 1 << 20)
    os.lseek(fd, size - back, os.SEEK_SET)
    tail = os.read(fd, back)
    cut = tail.rfind(b"\n")
    new_size = size - back + cut + 1 if cut >= 0 else (0 if back == size else size)
    os.ftruncate(fd, new_size)
    return new_size


def append_lines(path: str, lines: list[str], what: str, keep: str = "") -> None:
    """Append `lines` (each without its newline) to `path` whole or not at all: one write of all of them, and on
    a short or failed write the file is cut back to its size before; a torn last line left by a kill is cut
    off first, so every line of the file is a complete one."""
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    fd = None
    size = 0
    try:
        with writing(what, path, keep):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            size = _cut_torn_tail(fd, os.fstat(fd).st_size)
            os.lseek(fd, size, os.SEEK_SET)
            done = 0
            try:
                while done < len(data):
                    n = os.write(fd, data[done:])
                    if n <= 0:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                    done += n
            except BaseException:
                try:
                    os.ftruncate(fd, size)
                except OSError:
                    pass
                raise
    finally:
        if fd is not None:
            os.close(fd)


def remove_tree(path: str, what: str) -> None:
    """Remove folder `path` as one step: renamed aside first (so a kill never leaves a half-removed folder under
    its own name), then deleted."""
    if not os.path.lexists(path):
        return
    aside = temp_name(path, "del")
    with uninterrupted():
        with writing(f"(removing) {what}", path):
            os.rename(path, aside)
        _remove(aside)
