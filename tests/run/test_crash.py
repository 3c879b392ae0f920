"""Crash safety: a training process killed with SIGKILL at any moment, a checkpoint write included, leaves a
run that resumes from its latest complete checkpoint and ends exactly where an uninterrupted run ends.

The training processes are forked from a warm worker (`train_worker.py --serve`) so that each one does not pay
for importing torch and transformers again; each is a separate process, killed with SIGKILL."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import TESTS  # noqa: E402
from lmppo.run.folder import list_checkpoints
from lmppo.run.manifest import latest_checkpoint, verify_checkpoint
from lmppo.training.trainer import PPOTrainer
from train_worker import api_objects, comparable, make_config, read_jsonl

WORKER = os.path.join(TESTS, "train_worker.py")
ITERATIONS = 6
pytestmark = pytest.mark.skipif(not (hasattr(signal, "SIGKILL") and hasattr(os, "fork")), reason="needs fork, SIGKILL")


class Zygote:
    """The warm worker: `start(args)` forks a training process and returns its pid."""

    def __init__(self, tmp_path):
        self.marker = str(tmp_path / "marker")
        self.log = open(tmp_path / "worker-stderr.txt", "w+")
        env = dict(os.environ, PYTHONHASHSEED="0", WORKER_MARKER=self.marker)
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, "--serve"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
        )
        assert self.proc.stdout.readline().strip() == "ready", self.stderr()

    def stderr(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def start(self, out: str, *extra: str) -> int:
        for path in (self.marker, self.marker + ".started"):
            if os.path.exists(path):
                os.unlink(path)
        return int(self.ask(f"run {out} {ITERATIONS} " + " ".join(extra)))

    def wait_for(self, pid: int, started: bool = False, timeout: float = 120.0) -> None:
        """Until the training process `pid` stalls at its --stall point (or, `started`, has built its trainer)."""
        path = self.marker + (".started" if started else "")
        deadline = time.time() + timeout
        while not os.path.exists(path):
            if time.time() > deadline:
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"worker did not reach {path} in {timeout} s:\n{self.stderr()}")
            time.sleep(0.02)

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        status = int(self.ask(f"wait {pid}"))
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (status, self.stderr())

    def close(self) -> None:
        self.proc.kill()  # nothing to flush: every child has been waited for
        self.proc.wait(timeout=30)
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.log.close()


def checkpoint_iterations(out: str) -> list[int]:
    return sorted(i for i, _ in list_checkpoints(out))


def assert_latest_loads(out: str, iteration: int, tokenizer) -> None:
    """The latest complete checkpoint is `iteration`, verifies, and loads into a fresh trainer."""
    path = latest_checkpoint(out)
    assert path is not None and path.endswith(f"iter-{iteration:08d}"), (
        path,
        os.listdir(os.path.join(out, "checkpoints")),
    )
    verify_checkpoint(path)
    probe = PPOTrainer(
        make_config(
            out + "-probe",
            ITERATIONS,
            overwrite=True,
            checkpoint__every=1,
            checkpoint__keep_last=2,
            log__sample_every=1,
        ),
        **api_objects(tokenizer),
    )
    probe.load_checkpoint(path)
    assert probe.iteration == iteration and probe.episode == iteration * 8


@pytest.fixture()
def zygote(tmp_path):
    z = Zygote(tmp_path)
    yield z
    z.close()


@pytest.mark.slow
def test_sigkill_at_many_moments_then_resume_to_the_exact_end(tmp_path, tokenizer, zygote):
    out = str(tmp_path / "run")
    root = os.path.join(out, "checkpoints")

    # 1. killed inside the write of checkpoint 2: files written, no manifest. Checkpoint 1 is the latest.
    pid = zygote.start(out, "--stall", "write:2")
    zygote.wait_for(pid)
    zygote.kill(pid)
    assert checkpoint_iterations(out) == [1]
    assert os.path.isdir(os.path.join(root, ".iter-00000002.tmp"))
    assert not os.path.exists(os.path.join(root, ".iter-00000002.tmp", "manifest.json"))
    assert_latest_loads(out, 1, tokenizer)

    # 2. resumed, killed with checkpoint 3 complete in its temporary folder but not yet renamed into place.
    pid = zygote.start(out, "--resume", "--stall", "publish:3")
    zygote.wait_for(pid)
    zygote.kill(pid)
    assert os.path.exists(os.path.join(root, ".iter-00000003.tmp", "manifest.json"))
    assert checkpoint_iterations(out) == [1, 2]
    assert_latest_loads(out, 2, tokenizer)

    # 3. resumed, killed right after checkpoint 4 was renamed into place, before older ones were pruned.
    pid = zygote.start(out, "--resume", "--stall", "prune:4")
    zygote.wait_for(pid)
    zygote.kill(pid)
    assert checkpoint_iterations(out) == [2, 3, 4]  # 1 pruned when 3 was written; 2 not yet
    assert_latest_loads(out, 4, tokenizer)

    # 4. resumed, killed in the middle of iteration 6 (metrics of 5 logged, checkpoint 5 written).
    pid = zygote.start(out, "--resume", "--stall", "reward:6")
    zygote.wait_for(pid)
    zygote.kill(pid)
    assert checkpoint_iterations(out) == [4, 5]
    assert [m["iteration"] for m in read_jsonl(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3, 4, 5]
    assert_latest_loads(out, 5, tokenizer)

    # 5. resumed, killed at random moments once training runs (a checkpoint write, an update, or after the end).
    rng = random.Random(0)
    for _ in range(2):
        pid = zygote.start(out, "--resume")
        zygote.wait_for(pid, started=True)
        time.sleep(rng.uniform(0.0, 0.5))
        zygote.kill(pid) if _alive(pid) else zygote.ask(f"wait {pid}")
        assert latest_checkpoint(out) is not None

    # finish in this process; the result equals an uninterrupted run's, weights and metrics
    resumed = PPOTrainer.resume(out, **api_objects(tokenizer))
    resumed.train()
    straight_dir = str(tmp_path / "straight")
    straight = PPOTrainer(
        make_config(straight_dir, ITERATIONS, checkpoint__every=1, checkpoint__keep_last=2, log__sample_every=1),
        **api_objects(tokenizer),
    )
    straight.train()
    for (name, p), (_, q) in zip(straight.actor.named_parameters(), resumed.actor.named_parameters()):
        assert torch.equal(p, q), name
    got = read_jsonl(os.path.join(out, "metrics.jsonl"))
    want = read_jsonl(os.path.join(straight_dir, "metrics.jsonl"))
    assert [m["iteration"] for m in got] == list(range(1, ITERATIONS + 1))
    assert [comparable(m) for m in got] == [comparable(m) for m in want]
    assert read_jsonl(os.path.join(out, "samples.jsonl")) == read_jsonl(os.path.join(straight_dir, "samples.jsonl"))
    assert checkpoint_iterations(out) == [ITERATIONS - 1, ITERATIONS]
    assert not [n for n in os.listdir(root) if n.startswith(".")]  # leftovers of killed writes are cleaned up


def _alive(pid: int) -> bool:
    """True while `pid` runs (a finished child of the zygote is a zombie until waited for: not alive)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
