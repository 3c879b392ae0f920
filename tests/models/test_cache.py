"""lmppo.models.cache: a shared cache is filled by one process while the others wait (real processes, real kill)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmppo.models.cache import fill_file, fill_folder

REPO_SRC = str(Path(__file__).resolve().parents[2] / "src")

# One process filling `target`: its build appends to `builds`, writes `building`, then waits for `go` to appear
# (the test decides when the build ends: no timing). Prints what it finds in the target.
FILLER = r"""
import logging, os, sys, time
from pathlib import Path
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from lmppo.models.cache import fill_file, fill_folder
target, shared, kind = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

def build(tmp):
    with open(shared / "builds", "a") as fh:
        fh.write(f"{os.getpid()}\n")
    if kind == "folder":
        (tmp / "weights").write_text("half")
    else:
        tmp.write_text("half")
    (shared / "building").write_text("1")
    while not (shared / "go").exists():
        time.sleep(0.02)
    if kind == "folder":
        (tmp / "weights").write_text("w")
        (tmp / "done").write_text("1")
    else:
        tmp.write_text("done")

if kind == "folder":
    fill_folder(target, build, lambda p: (p / "done").is_file(), "the test build")
    print(sorted(os.listdir(target)))
else:
    fill_file(target, build, lambda p: p.is_file() and p.read_text() == "done", "the test build")
    print(target.read_text())
"""


def _start(target: Path, shared: Path, kind: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO_SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-c", FILLER, str(target), str(shared), kind],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(predicate, proc: subprocess.Popen, what: str, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the process ended before {what}: {proc.communicate()}")
        assert time.monotonic() < deadline, f"no {what} after {limit} s"
        time.sleep(0.02)


class _StderrWatch:
    """Collects a process's stderr lines in a thread, so the test can wait for one."""

    def __init__(self, proc: subprocess.Popen):
        import threading

        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(iter(proc.stderr.readline, "")), daemon=True)
        self.thread.start()

    def saw(self, text: str) -> bool:
        return any(text in line for line in self.lines)


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_two_processes_fill_once_and_the_second_waits(tmp_path, kind):
    target, shared = tmp_path / "cache" / "thing", tmp_path
    first = _start(target, shared, kind)
    _wait_for(lambda: (shared / "building").exists(), first, "the first build started")
    second = _start(target, shared, kind)
    watch = _StderrWatch(second)
    _wait_for(lambda: watch.saw("waiting for another process to finish the test build"), second, "a wait message")
    assert not target.exists()  # nothing half-built is visible while the first one builds
    (shared / "go").write_text("1")
    out1, err1 = first.communicate(timeout=120)
    out2, _ = second.communicate(timeout=120)
    watch.thread.join(timeout=10)
    assert first.returncode == 0 and second.returncode == 0, (err1, watch.lines)
    assert (shared / "builds").read_text().splitlines() == [str(first.pid)]  # built once, by the first
    assert out1 == out2  # both see the same, whole target
    assert out1.strip() == ("['done', 'weights']" if kind == "folder" else "done")
    assert sorted(p.name for p in target.parent.iterdir()) == [".thing.lock", "thing"]  # no temporary left


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_killed_builder_leaves_nothing_the_next_one_trusts(tmp_path, kind):
    target, shared = tmp_path / "cache" / "thing", tmp_path
    first = _start(target, shared, kind)
    _wait_for(lambda: (shared / "building").exists(), first, "the first build started")
    os.kill(first.pid, signal.SIGKILL)
    first.communicate(timeout=60)
    assert not target.exists()
    assert any(p.name.startswith(".thing.tmp-") for p in target.parent.iterdir())  # the killed one's temporary

    def build(tmp: Path) -> None:
        if kind == "folder":
            (tmp / "done").write_text("1")
        else:
            tmp.write_text("done")

    complete = (lambda p: (p / "done").is_file()) if kind == "folder" else (lambda p: p.is_file())
    fill = fill_folder if kind == "folder" else fill_file
    assert fill(target, build, complete, "the test build") == target
    assert complete(target)
    assert sorted(p.name for p in target.parent.iterdir()) == [".thing.lock", "thing"]


def test_a_stale_folder_is_replaced_whole(tmp_path):
    target = tmp_path / "thing"
    target.mkdir()
    (target / "old").write_text("stale")

    def build(tmp: Path) -> None:
        (tmp / "new").write_text("1")

    fill_folder(target, build, lambda p: (p / "new").is_file(), "the test build")
    assert sorted(os.listdir(target)) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".thing.lock", "thing"]


def test_a_failed_build_leaves_the_target_as_it_was(tmp_path):
    target = tmp_path / "thing"

    def build(tmp: Path) -> None:
        (tmp / "half").write_text("1")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        fill_folder(target, build, lambda p: (p / "done").is_file(), "the test build")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".thing.lock"]
