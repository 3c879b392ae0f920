"""The benchmarks' one sys.path set-up: every benchmark folder on the path, so a script run as
`python benchmarks/<kind>/<name>.py` imports shared code and other scripts by bare name (`import common`,
`import compare_trl`). ROOT, SRC and TESTS name the repository's folders; `put_first(SRC, TESTS)` puts them ahead.

A script finds this file with one line, then imports it:

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))
    import bench_path  # noqa: E402
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
ROOT = BENCHMARKS.parent
SRC = ROOT / "src"
TESTS = ROOT / "tests"
KINDS = ("shared", "speed", "memory", "learning", "tools")


def put_first(*folders: Path) -> None:
    """Put folders ahead of everything on sys.path, in the order given (src/ before a PYTHONPATH's lmppo, say)."""
    for folder in reversed(folders):
        sys.path.insert(0, str(folder))


# after the script's own folder, ahead of PYTHONPATH and site-packages, as benchmarks/ was when the scripts sat there
for _i, _kind in enumerate(KINDS, start=1):
    if str(BENCHMARKS / _kind) not in sys.path:
        sys.path.insert(_i, str(BENCHMARKS / _kind))
