"""Checkpoints: atomic writes and exact resume.

A checkpoint folder is written under a temporary name, every file flushed to disk, then renamed into place:
a run killed at any moment leaves either the previous complete checkpoint or the new complete one.
"""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from typing import Iterator


def _fsync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_dir(final_path: str) -> Iterator[str]:
    """Yield a temporary folder beside `final_path`; on success flush it and rename it to `final_path`
    (replacing an older folder of that name). On failure the temporary folder is removed and any existing
    `final_path` is left untouched."""
    parent = os.path.dirname(os.path.abspath(final_path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(final_path)}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        yield tmp
        _fsync_tree(tmp)
        if os.path.exists(final_path):
            old = os.path.join(parent, f".{os.path.basename(final_path)}.old-{uuid.uuid4().hex[:8]}")
            os.rename(final_path, old)
            os.rename(tmp, final_path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final_path)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
