"""Memory on CPU: keep freed blocks for reuse instead of handing them back to the operating system.

Design notes: docs/design.md, `lmppo.models.cpu_memory`."""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's <malloc.h>
THRESHOLD = 1 << 30  # bytes


def keep_freed_memory(threshold: int = THRESHOLD) -> bool:
    """Raise glibc's mmap and trim thresholds to `threshold` bytes; True when it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1 and mallopt(M_TRIM_THRESHOLD, threshold) == 1
