"""lmppo's own error types.

Every mistake a user can make (a bad config value, a missing file, a reward function that returns
garbage) is raised as one of these, with a message that names the field or file, the value, and what is
allowed. The CLI prints the message on one line and exits non-zero; a traceback only with ``--debug``.
"""

from __future__ import annotations

import errno

from lmppo.redact import redact_text


class LmppoError(Exception):
    """Base class of every error lmppo raises on purpose."""


class ConfigError(LmppoError, ValueError):
    """A config field has a value that is not allowed, or fields contradict each other."""

    def __init__(self, field: str, value: object, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"config field `{field}` = {bounded_repr(value)}: {allowed}")


def bounded_repr(value: object, limit: int = 300) -> str:
    """repr of `value` for a message: bounded work and length whatever the value (a huge or deeply shared
    structure from hostile input), credentials masked. Strings up to 10k characters are masked whole before
    they are cut to `limit`."""
    import reprlib

    r = reprlib.Repr()
    r.maxstring, r.maxother, r.maxlevel = 10_000, 400, 4
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = r.maxfrozenset = r.maxdeque = r.maxarray = 12
    try:
        text = r.repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails still gets its error message
        text = f"<{type(value).__name__}>"
    text = _redact(text)
    return text if len(text) <= limit else text[:limit] + " ..."


def _redact(text: str) -> str:
    """Mask credentials (user:password@ in URLs, tokens) in a value before it reaches a message."""
    return redact_text(text)


class DataError(LmppoError, ValueError):
    """The prompt data cannot be read or is unusable."""


class RewardError(LmppoError, RuntimeError):
    """A reward source failed or returned something lmppo cannot use."""


class CheckpointError(LmppoError, RuntimeError):
    """A checkpoint is missing, corrupt, or belongs to a different run."""


class TrainingError(LmppoError, RuntimeError):
    """Training cannot go on (for example too many non-finite updates in a row)."""


class StorageError(LmppoError, RuntimeError):
    """Writing the run's state failed (full disk, read-only folder, ...); what was complete before is intact."""


class RunLockedError(LmppoError, RuntimeError):
    """Another lmppo process is using the output folder."""


_NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", -1))


def write_failure_words(err: BaseException) -> str | None:
    """Why a write failed, in words, when the error says so (an errno, or the message of torch / safetensors:
    "os error 28"); None when it does not (`lmppo.run.storage.reason` then looks at the disk)."""
    code = getattr(err, "errno", None)
    text = str(err)
    if isinstance(err, OSError) and code is None and err.args and isinstance(err.args[0], int):
        code = err.args[0]
    if code in _NO_SPACE or "No space left" in text or "os error 28" in text:
        return "the disk is full (no space left on device)"
    if code == errno.EFBIG or "File too large" in text or "os error 27" in text:
        return "the file is larger than this process may write (file size limit: ulimit -f)"
    if code == errno.EROFS or "Read-only file system" in text or "os error 30" in text:
        return "the file system is read-only"
    if code in (errno.EACCES, errno.EPERM) or "Permission denied" in text or "os error 13" in text:
        return "permission denied"
    if code == errno.ENOENT or "No such file or directory" in text:
        return "the folder does not exist (removed while writing?)"
    if code == errno.ENOTDIR:
        return "a path component is a file, not a folder"
    if code == errno.EIO:
        return "input/output error (failing disk or network file system)"
    return None
