"""Exact resume with an environment: a run SIGKILLed in the middle of an iteration and resumed with `--resume`
ends with the metrics and weights of an uninterrupted run, bit for bit (the environments are built afresh for each
episode from the prompt rows, and the sampling of every turn is seeded per response)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from conftest import TESTS
from train_worker import comparable, read_jsonl

WORKER = os.path.join(TESTS, "env_worker.py")
pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")


def run(out: str, env: str, *extra: str, marker: str | None = None, on_error: str = "stop") -> subprocess.Popen:
    environ = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", WORKER_ON_ERROR=on_error)
    environ.pop("WORKER_MARKER", None)
    if marker:
        environ["WORKER_MARKER"] = marker
    return subprocess.Popen([sys.executable, WORKER, out, env, *extra], env=environ, stderr=subprocess.PIPE, text=True)


def weights(out: str) -> dict:
    folder = os.path.join(out, "final", "policy")
    (name,) = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    return load_file(os.path.join(folder, name))


@pytest.mark.parametrize("name,on_error", [("Countdown", "stop"), ("DropsThrees", "drop")])
def test_sigkill_mid_run_then_resume_is_bit_identical(tmp_path, name, on_error):
    """Also with episodes dropped (`environment.on_error: drop`: the rows of 3 turns fail at their 2nd turn)."""
    env = os.path.join(TESTS, "countdown_env.py") + ":" + name  # rows with per_word: rewards follow the samples
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    reference = run(whole, env, on_error=on_error)
    marker = str(tmp_path / "marker")
    victim = run(cut, env, marker=marker, on_error=on_error)
    deadline = time.time() + 300
    while not os.path.exists(marker):
        assert victim.poll() is None, victim.stderr.read()[-3000:]
        assert time.time() < deadline, "the run never reached iteration 2"
        time.sleep(0.05)
    time.sleep(0.7)  # into iteration 3 (the worker pauses 0.5 s per logged step from iteration 2 on)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert not os.path.exists(os.path.join(cut, "final"))  # it did not finish
    assert len(read_jsonl(os.path.join(cut, "metrics.jsonl"))) in (2, 3)  # killed during iteration 3 or 4
    resumed = run(cut, env, "resume", on_error=on_error)
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()[-3000:]
    assert reference.wait(timeout=600) == 0, reference.stderr.read()[-3000:]
    rows_whole = [comparable(r) for r in read_jsonl(os.path.join(whole, "metrics.jsonl"))]
    rows_cut = [comparable(r) for r in read_jsonl(os.path.join(cut, "metrics.jsonl"))]
    assert len(rows_whole) == 4 and rows_cut == rows_whole
    assert rows_whole[-1]["episode/turns"] > 1  # the runs really played multi-turn episodes
    dropped = [r["episode/dropped"] for r in rows_whole]
    assert (sum(dropped) > 0) == (on_error == "drop"), dropped  # and dropped some, with drop
    a, b = weights(whole), weights(cut)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
