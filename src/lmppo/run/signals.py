"""Every stop signal ends an lmppo command the way Ctrl-C does: the writes in progress remove their temporaries, the
command prints one line saying what happened and what to do, and it exits with 128 + the signal's number (Ctrl-C
130, SIGTERM 143, SIGHUP 129: the shell's codes).

Schedulers (Slurm, Kubernetes, systemd) stop a job with SIGTERM, a closed terminal or ssh session sends SIGHUP;
Python's default for both is to die at once, leaving temporaries and no message. `install` makes each raise a
`KeyboardInterrupt` (`Stopped` for SIGTERM / SIGHUP) in the main thread instead, so every `except BaseException`
clean-up of lmppo's writers runs. The CLI installs it first thing, before its slow imports. After the first signal
the others are ignored (a second Ctrl-C 20 ms later does not cut the clean-up or its message short; SIGKILL still
ends the process, and the next process that takes the run lock removes what is left,
`lmppo.run.storage.remove_temporaries`). A signal that arrives inside an import is raised when the outermost import
returns: an import may run inside a C extension's call (torch's `_c10d_init`, pydantic-core's datetime capsule),
and an exception raised there aborts the process (`terminate called after throwing ... error_already_set`) instead
of unwinding. Once the command has ended, a late signal (during the interpreter's exit)
prints one line and exits at once (`ended`).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from types import FrameType
from typing import Optional, Sequence

import lmppo.run.storage as storage
from lmppo.run.layout import CHECKPOINT_NAME, CHECKPOINTS, CONFIG, MANIFEST

EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
STOP_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)
_HOW: dict[int, str] = {int(signal.SIGINT): "interrupted", int(signal.SIGTERM): "terminated (SIGTERM)"}
if hasattr(signal, "SIGHUP"):
    _HOW[int(signal.SIGHUP)] = "hung up (SIGHUP: the terminal or session closed)"


class Stopped(KeyboardInterrupt):
    """Raised in the main thread when the process receives a stop signal other than Ctrl-C (`install`)."""

    signum: int = signal.SIGTERM

    def __init__(self, signum: Optional[int] = None):
        super().__init__()
        if signum is not None:
            self.signum = signum


class Terminated(Stopped):
    """SIGTERM (`install`)."""

    signum = signal.SIGTERM


def _stop_for(signum: int) -> KeyboardInterrupt:
    if signum == signal.SIGINT:
        return KeyboardInterrupt()
    return Terminated() if signum == signal.SIGTERM else Stopped(signum)


IMPORT_WAIT_S = 30.0
"""The longest a stop waits for an import to end (a program that trains inside an import is still stopped)."""


class _Held:
    """The stop held for an import under way (`_wait_for_the_import`), and since when."""

    stop: Optional[BaseException] = None
    since: float = 0.0


def _on_signal(signum: int, frame: Optional[FrameType]) -> None:
    for other in STOP_SIGNALS:  # one clean-up: the signals after the first do not interrupt it
        signal.signal(other, signal.SIG_IGN)
    if importing(frame) and _wait_for_the_import(_stop_for(signum)):
        return
    _stop(_stop_for(signum))


def _is_import_machinery(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith("<frozen importlib._bootstrap")


def importing(frame: Optional[FrameType]) -> bool:
    """Whether `frame` runs inside an import (a frame of `importlib._bootstrap` is below it)."""
    while frame is not None:
        if _is_import_machinery(frame):
            return True
        frame = frame.f_back
    return False


def _wait_for_the_import(stop: BaseException) -> bool:
    """Hold `stop` until the outermost import under way returns, and raise it there (a profile hook, which sees every
    frame's return); False where a profiler is already set (the stop is raised at once then)."""
    if sys.getprofile() is not None:
        return False
    _Held.stop, _Held.since = stop, time.monotonic()
    sys.setprofile(_after_the_import)
    return True


def _after_the_import(frame: FrameType, event: str, arg: object) -> None:
    outermost_import_returns = event == "return" and _is_import_machinery(frame) and not importing(frame.f_back)
    waited_too_long = event == "call" and time.monotonic() - _Held.since > IMPORT_WAIT_S
    if not (outermost_import_returns or waited_too_long):
        return
    stop = _Held.stop
    _stop_waiting()
    if stop is not None:
        _stop(stop)  # the import statement raises it, with its module complete in sys.modules


def _stop_waiting() -> None:
    """Remove the hook of `_wait_for_the_import`, if it is set."""
    if _Held.stop is not None:
        sys.setprofile(None)
        _Held.stop = None


def _stop(exc: BaseException) -> None:
    """Raise `exc` now, or when the rename or removal under way ends (`lmppo.run.storage.uninterrupted`)."""
    if storage.interruptible():
        raise exc
    storage.defer(exc)


def install() -> bool:
    """Make Ctrl-C, SIGTERM and SIGHUP raise (`KeyboardInterrupt`, `Terminated`, `Stopped`) in this process (main
    thread only), each waiting for a rename or removal under way; returns whether it was installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for signum in STOP_SIGNALS:
        if signum != signal.SIGINT or signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signum, _on_signal)
    return True


terminate_like_interrupt = install  # the name of earlier versions


def handlers() -> dict[int, object]:
    """The handlers of the stop signals now (for `restore`)."""
    return {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}


def restore(saved: dict[int, object]) -> None:
    """Put back the handlers `handlers` returned (main thread only)."""
    if threading.current_thread() is threading.main_thread():
        _stop_waiting()
        for signum, handler in saved.items():
            if handler is not None:
                signal.signal(signum, handler)  # type: ignore[arg-type]


def ended(code: int) -> None:
    """The command has ended with exit code `code`: a stop signal from now on (the interpreter's exit, its atexit
    handlers) prints one line and exits at once with 128 + its number, instead of a traceback from an exit handler.
    Signals that are ignored (after a first one) stay ignored."""
    if threading.current_thread() is not threading.main_thread():
        return
    _stop_waiting()  # a stop held for an import that outlived the command: the command has ended all the same

    def late(signum: int, frame: Optional[FrameType]) -> None:
        how = _HOW.get(signum, f"signal {signum}")
        sys.stderr.write(f"{how} while exiting; the command had ended (exit code {code})\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, late)


def exit_code(interrupt: BaseException) -> int:
    """The exit code for an interrupted command: 128 + the signal's number (Ctrl-C 130, SIGTERM 143, SIGHUP 129)."""
    return 128 + (interrupt.signum if isinstance(interrupt, Stopped) else signal.SIGINT)


def how_stopped(interrupt: BaseException) -> str:
    """`terminated (SIGTERM)`, `hung up (SIGHUP ...)` or `interrupted` (Ctrl-C), for the message."""
    return _HOW.get(interrupt.signum if isinstance(interrupt, Stopped) else signal.SIGINT, "interrupted")


def has_checkpoint(output_dir: str) -> bool:
    """Whether run folder `output_dir` holds a published checkpoint (`checkpoints/iter-N/manifest.json`)."""
    root = os.path.join(output_dir, CHECKPOINTS)
    try:
        names = os.listdir(root)
    except OSError:
        return False
    return any(CHECKPOINT_NAME.match(n) and os.path.isfile(os.path.join(root, n, MANIFEST)) for n in names)


def go_on(output_dir: str) -> str:
    """How to continue run `output_dir` after a failure that left it as it was (free space first, say): `--resume`
    when it holds a checkpoint, else the same command again with `--overwrite true` (nothing to resume)."""
    if has_checkpoint(output_dir):
        return f"continue with `lmppo train --resume {output_dir}`"
    return (
        "start it again with the same `lmppo train` command and `--overwrite true` (it has no checkpoint yet, so "
        "there is nothing to resume)"
    )


def next_step(output_dir: Optional[str], argv: Sequence[str]) -> str:
    """What to run after `lmppo train ARGV` into `output_dir` stopped: `--resume` when a checkpoint exists, else
    the same command with `--overwrite true` (there is nothing to resume)."""
    if not output_dir:
        return (
            "resume with `lmppo train --resume OUTPUT_DIR` (or, if it wrote no checkpoint, rerun with --overwrite true)"
        )
    if has_checkpoint(output_dir):
        return f"the latest complete checkpoint is intact: resume with `lmppo train --resume {output_dir}`"
    args, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--overwrite="):
            skip = False
            continue
        if arg == "--overwrite":
            skip = True
            continue
        args.append(arg)
    if "--resume" in args:
        args = [os.path.join(output_dir, CONFIG)]
    return (
        "it wrote no checkpoint, so there is nothing to resume: start it again with "
        f"`lmppo train {shlex.join(args)} --overwrite true`"
    )
