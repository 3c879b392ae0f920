"""The console of the `lmppo` command (lmppo.apps.console), in a real subprocess: its settings are process-wide."""

import subprocess
import sys

from conftest import REPO

SCRIPT = """
import os, sys, warnings
from lmppo.apps.console import quiet_console
quiet_console(debug={debug})
warnings.warn("library notice", FutureWarning)
from transformers.utils import logging as hf_logging
print("bars", hf_logging.is_progress_bar_enabled(), "debug", os.environ.get("LMPPO_DEBUG"))
"""


def _run(debug: bool, then: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.format(debug=debug) + then],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{REPO}/src", "HOME": "/tmp"},
    )


def test_without_debug_library_notices_and_bars_are_off():
    done = _run(debug=False)
    assert done.returncode == 0, done.stderr
    assert "FutureWarning" not in done.stderr and "library notice" not in done.stderr
    assert "bars False debug None" in done.stdout


def test_lmppos_own_warnings_are_one_line():
    done = _run(debug=False, then="warnings.warn('kept 2 file(s) lmppo did not write: a, b', UserWarning)\n")
    assert done.returncode == 0, done.stderr
    assert done.stderr == "warning: kept 2 file(s) lmppo did not write: a, b\n"


def test_debug_shows_the_notices():
    done = _run(debug=True)
    assert done.returncode == 0, done.stderr
    assert "library notice" in done.stderr
    assert "debug 1" in done.stdout
