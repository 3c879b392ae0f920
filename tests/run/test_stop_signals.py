"""Every stop signal at any moment ends `lmppo` with one line and 128 + N (issue 41, cases 7, 8, 11): SIGTERM and
SIGHUP during start-up's slow imports, SIGHUP during training, a second Ctrl-C 20 ms after the first, and a finished
run leaves no `.lmppo.lock`. Real processes, real signals."""

from __future__ import annotations

import os
import signal
import time

import pytest
from test_real_faults import base_config, cli_process, finish, wait_for_file
from test_signals_and_leftovers import gated

import lmppo.run.storage as storage
from lmppo.run import signals


def wait_until_caught(proc, signum: int, timeout: float = 120) -> None:
    """Wait until process `proc` catches `signum` (Linux: the SigCgt mask of /proc/PID/status), so a signal sent
    after this meets lmppo's handler whatever the machine's load made of the interpreter's start."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, finish(proc)
        with open(f"/proc/{proc.pid}/status") as status:
            caught = next(int(ln.split()[1], 16) for ln in status if ln.startswith("SigCgt:"))
        if caught >> (int(signum) - 1) & 1:
            return
        time.sleep(0.005)
    raise AssertionError(f"the process never caught signal {signum}")


def _no_traceback(lines: list[str]) -> None:
    text = "\n".join(lines)
    assert "Traceback" not in text and "Exception ignored" not in text and "KeyboardInterrupt" not in text, text


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)])
@pytest.mark.parametrize("after", [0.3, 0.9])
def test_a_signal_during_start_up_ends_with_one_line_and_128_plus_n(tmp_path, tiny_model_dir, signum, code, after):
    out = str(tmp_path / "run")
    proc = cli_process(["train", base_config(tmp_path, tiny_model_dir, out)])
    wait_until_caught(proc, signum)  # lmppo's first lines ran (before them the kernel's default applies)
    time.sleep(after)  # inside the imports of torch / transformers (about 1.5 s on this machine)
    proc.send_signal(signum)
    rc, lines = finish(proc)
    assert rc == code and len(lines) == 1, (rc, lines)
    _no_traceback(lines)
    assert lines[0].startswith(signals.how_stopped(signals._stop_for(signum)) + ";"), lines
    assert storage.temporaries(out) == [] if os.path.isdir(out) else True


TRIP = """
import os, signal, sys
SIGNUM, MODULE = int(sys.argv[1]), sys.argv[2]


class Trip:  # sends the signal from inside the import of MODULE, whoever imports it
    def find_spec(self, name, path=None, target=None):
        if name == MODULE:
            os.kill(os.getpid(), SIGNUM)
        return None


sys.meta_path.insert(0, Trip())
sys.argv = ["lmppo", "train", sys.argv[3]]
from lmppo.apps.cli import main

sys.exit(main())
"""


@pytest.mark.parametrize(
    "module",
    [
        "datetime",  # imported from pydantic-core's Rust code (PyCapsule_Import): a raise there was a PanicException
        "torch._opaque_base",  # imported from torch's C++ `_c10d_init`, where CI saw `terminate called after ...`
        "transformers",
    ],
)
@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_inside_an_import_made_by_a_c_extension_ends_with_one_line(
    tmp_path, tiny_model_dir, module, signum, code
):
    import subprocess
    import sys

    from test_real_faults import SRC

    out = str(tmp_path / "run")
    proc = subprocess.run(
        [sys.executable, "-c", TRIP, str(int(signum)), module, base_config(tmp_path, tiny_model_dir, out)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=SRC, HF_HUB_OFFLINE="1"),
        timeout=600,
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == code and len(lines) == 1, (proc.returncode, lines[-6:])
    _no_traceback(lines)
    assert lines[0].startswith(signals.how_stopped(signals._stop_for(signum)) + ";"), lines


def test_sighup_during_training_exits_129_with_advice_that_works(tmp_path, tiny_model_dir):
    out, gate = str(tmp_path / "run"), str(tmp_path / "gate")
    proc = cli_process(["train", gated(tmp_path, tiny_model_dir, out)], GATE=gate, GATE_CALL="2")
    wait_for_file(gate + ".reached", proc)
    proc.send_signal(signal.SIGHUP)
    rc, lines = finish(proc)
    assert rc == 129 and len(lines) == 1, (rc, lines)
    assert lines[0] == (
        "hung up (SIGHUP: the terminal or session closed); the latest complete checkpoint is intact: resume with "
        f"`lmppo train --resume {out}`"
    )
    assert storage.temporaries(out) == []
    rc, lines = finish(cli_process(["train", "--resume", out]))
    assert rc == 0, lines


def test_a_second_ctrl_c_20_ms_after_the_first_prints_no_traceback(tmp_path, tiny_model_dir):
    out, gate = str(tmp_path / "run"), str(tmp_path / "gate")
    proc = cli_process(["train", gated(tmp_path, tiny_model_dir, out)], GATE=gate, GATE_CALL="2")
    wait_for_file(gate + ".reached", proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    rc, lines = finish(proc)
    assert rc == 130 and len(lines) == 1, (rc, lines)
    _no_traceback(lines)
    assert lines[0].startswith("interrupted; the latest complete checkpoint is intact")
    assert storage.temporaries(out) == []


def test_a_finished_run_leaves_no_lock_file(tmp_path, tiny_model_dir):
    out = str(tmp_path / "run")
    rc, lines = finish(cli_process(["train", base_config(tmp_path, tiny_model_dir, out, iterations=1)]))
    assert rc == 0, lines
    assert not os.path.exists(os.path.join(out, ".lmppo.lock"))
    assert os.path.isdir(os.path.join(out, "final"))


def test_a_stop_inside_an_import_is_raised_when_the_outermost_import_returns_with_its_modules_complete(
    tmp_path, monkeypatch
):
    import importlib
    import sys

    (tmp_path / "lmppo_outer_mod.py").write_text("import lmppo_inner_mod\nAFTER = lmppo_inner_mod.DONE + 1\n")
    (tmp_path / "lmppo_inner_mod.py").write_text(
        "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\nDONE = sum(range(1000))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    before = signals.handlers()
    signals.install()
    try:
        with pytest.raises(signals.Terminated):
            importlib.import_module("lmppo_outer_mod")
        assert sys.modules["lmppo_inner_mod"].DONE == 499500  # neither import was cut in two
        assert sys.modules["lmppo_outer_mod"].AFTER == 499501
        assert sys.getprofile() is None  # the hook that held the stop is gone
    finally:
        signals.restore(before)
        sys.modules.pop("lmppo_outer_mod", None)
        sys.modules.pop("lmppo_inner_mod", None)
