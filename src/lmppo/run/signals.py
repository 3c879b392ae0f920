"""SIGTERM ends a run the way Ctrl-C (SIGINT) does: the writes in progress remove their temporaries, the command
prints how to go on, and it exits with 143 (128 + 15, the shell's code for SIGTERM; Ctrl-C: 130).

Schedulers (Slurm, Kubernetes, systemd) stop a job with SIGTERM, then SIGKILL a few seconds later. Python's default
for SIGTERM is to die at once, leaving temporaries and no message; `terminate_like_interrupt` raises `Terminated`
(a KeyboardInterrupt) in the main thread instead, so every `except BaseException` clean-up of lmppo's writers runs.
A second SIGTERM during that clean-up is ignored (SIGKILL still ends the process; the next process that takes the
run lock removes what is left, `lmppo.run.storage.remove_temporaries`).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import threading
from types import FrameType
from typing import Optional, Sequence

import lmppo.run.storage as storage

EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
_CHECKPOINT = re.compile(r"^iter-\d+$")


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when the process receives SIGTERM (`terminate_like_interrupt`)."""


def _on_sigterm(signum: int, frame: Optional[FrameType]) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one clean-up: a second SIGTERM does not interrupt it
    _stop(Terminated())


def _on_sigint(signum: int, frame: Optional[FrameType]) -> None:
    _stop(KeyboardInterrupt())


def _stop(exc: BaseException) -> None:
    """Raise `exc` now, or when the rename or removal under way ends (`lmppo.run.storage.uninterrupted`)."""
    if storage.interruptible():
        raise exc
    storage.defer(exc)


def terminate_like_interrupt() -> bool:
    """Make SIGTERM raise `Terminated` in this process (main thread only), and both SIGTERM and Ctrl-C wait for
    a rename or removal under way; returns whether it was installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
    return True


def exit_code(interrupt: BaseException) -> int:
    """The exit code for an interrupted command: 143 after SIGTERM, 130 after Ctrl-C."""
    return EXIT_TERMINATED if isinstance(interrupt, Terminated) else EXIT_INTERRUPTED


def how_stopped(interrupt: BaseException) -> str:
    """`terminated (SIGTERM)` or `interrupted`, for the message."""
    return "terminated (SIGTERM)" if isinstance(interrupt, Terminated) else "interrupted"


def has_checkpoint(output_dir: str) -> bool:
    """Whether run folder `output_dir` holds a published checkpoint (`checkpoints/iter-N/manifest.json`)."""
    root = os.path.join(output_dir, "checkpoints")
    try:
        names = os.listdir(root)
    except OSError:
        return False
    return any(_CHECKPOINT.match(n) and os.path.isfile(os.path.join(root, n, "manifest.json")) for n in names)


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
        args = [os.path.join(output_dir, "config.yaml")]
    return (
        "it wrote no checkpoint, so there is nothing to resume: start it again with "
        f"`lmppo train {shlex.join(args)} --overwrite true`"
    )
