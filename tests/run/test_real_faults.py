"""Real faults, not mocked ones: a full disk (a small tmpfs, and a file-size limit that needs no mount rights),
two processes racing for one output folder, truncated and garbage model files. The failing writer is always
the real one (torch.save, safetensors, open/write, save_pretrained); what a test controls is only *when* the disk
fills, by writing a real filler file at a chosen moment.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest
import yaml

import lmppo.run.lock as lock
import lmppo.run.storage as storage
import lmppo.training.trainer as trainer_module
from conftest import TESTS, ctrl_c_as_in_a_terminal  # noqa: E402
from lmppo.apps.cli import main
from lmppo.errors import RunLockedError
from train_worker import read_jsonl

HERE = TESTS
SRC = os.path.join(os.path.dirname(HERE), "src")


# ----------------------------------------------------------------------------- helpers


def run_cli(argv, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip()]
    return code, "\n".join(lines)


def assert_one_clean_line(code: int, err: str, *names: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("error: "), err
    for name in names:
        assert name in err, (name, err)


def base_config(tmp_path, model_dir: str, out: str, iterations: int = 3, **extra) -> str:
    (tmp_path / "prompts.txt").write_text("the movie was\nthis film is\nmy friend felt\nthe story seemed\n")
    (tmp_path / "rewards.py").write_text(
        "def ok(prompts, completions):\n    return [len(c) / 20.0 for c in completions]\n"
    )
    cfg = {
        "output_dir": out,
        "total_episodes": 4 * iterations,
        "model": {"policy": model_dir},
        "precision": "fp32",
        "data": {"prompts": str(tmp_path / "prompts.txt")},
        "rollout": {"batch_size": 4, "max_new_tokens": 4, "stop_token": "none"},
        "reward": {"sources": [{"kind": "function", "path": f"{tmp_path / 'rewards.py'}:ok"}]},
        "ppo": {"num_epochs": 1, "micro_batch_size": 4},
        "log": {"trackers": [], "sample_every": 1},
        "checkpoint": {"every": 1},
    }
    for dotted, value in extra.items():
        obj = cfg
        *parents, leaf = dotted.split("__")
        for p in parents:
            obj = obj.setdefault(p, {})
        obj[leaf] = value
    path = tmp_path / f"config-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.fixture()
def small_disk(tmp_path):
    """A real, small file system (tmpfs, 8 MiB) mounted in tmp_path; skipped where mounting is not allowed."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root (the RLIMIT_FSIZE variant below runs everywhere)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the RLIMIT_FSIZE variant runs instead")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(disk: str, leave: int) -> str:
    """Fill the file system of `disk` with a real file until `leave` bytes are free; returns the filler's path."""
    path = os.path.join(disk, "filler")
    st = os.statvfs(disk)
    free = st.f_bavail * st.f_frsize
    with open(path, "ab") as fh:
        fh.write(b"\0" * max(free - leave, 0))
    return path


def pad_to_page(path: str, page: int = 4096) -> None:
    """Append one JSON row (no `iteration`: a resume drops it) that ends `path` at a page boundary, so that the
    next append needs a new page of the file system (tmpfs keeps files in whole pages)."""
    size = os.path.getsize(path)
    room = (-size - len('{"pad": ""}\n')) % page
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"pad": "x" * room}) + "\n")


def fill_after_checkpoint(monkeypatch, disk: str, at_iteration: int, leave, pad: str = "") -> dict:
    """After the checkpoint of iteration `at_iteration` is written, the disk fills up (to `leave(folder)` free);
    `pad`: a log file of the run to end at a page boundary first."""
    real = trainer_module.checkpoint_trainer
    state: dict = {}

    def save_then_fill(trainer):
        folder = real(trainer)
        if trainer.iteration == at_iteration:
            if pad:
                pad_to_page(os.path.join(trainer.config.output_dir, pad))
            state["filler"] = fill(disk, leave(folder))
        return folder

    monkeypatch.setattr(trainer_module, "checkpoint_trainer", save_then_fill)  # the name the trainer calls
    return state


def assert_whole_lines(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    assert text == "" or text.endswith("\n"), text[-200:]
    return [json.loads(line) for line in text.splitlines()]


def resume_to_the_end(out: str, capsys, iterations: int = 3) -> None:
    code, err = run_cli(["train", "--resume", out], capsys)
    assert code == 0, err
    rows = assert_whole_lines(os.path.join(out, "metrics.jsonl"))
    assert [r["iteration"] for r in rows] == list(range(1, iterations + 1))
    assert os.path.isdir(os.path.join(out, "final", "policy"))


# ----------------------------------------------------------------------------- a full disk, for real


def _size(folder: str, name: str) -> int:
    return os.path.getsize(os.path.join(folder, name))


FULL_DISK_MOMENTS = {
    # where the disk fills: bytes left free after the checkpoint of iteration 1, as a function of that folder
    "safetensors (RNG state, the first file)": lambda f: 4 * 1024,
    "safetensors (trained weights)": lambda f: (
        _size(f, "rng-rank0.safetensors") + _size(f, "rng-rank0.json") + 24 * 1024
    ),
    "torch.save (optimizer)": lambda f: _size(f, "trained.safetensors") + 24 * 1024,
}


@pytest.mark.parametrize("moment", list(FULL_DISK_MOMENTS))
def test_full_disk_during_a_real_checkpoint_write(tmp_path, tiny_model_dir, small_disk, monkeypatch, capsys, moment):
    out = os.path.join(small_disk, "run")
    fill_after_checkpoint(monkeypatch, small_disk, 1, FULL_DISK_MOMENTS[moment])
    code, err = run_cli(["train", base_config(tmp_path, tiny_model_dir, out, log__sample_every=0)], capsys)
    root = os.path.join(out, "checkpoints")
    assert_one_clean_line(
        code,
        err,
        "could not write the checkpoint of iteration 2",
        root,
        "the disk is full",
        "iter-00000001 is intact",
        f"lmppo train --resume {out}",
    )
    assert sorted(os.listdir(root)) == ["iter-00000001"] and storage.temporaries(out) == []
    monkeypatch.undo()
    os.unlink(os.path.join(small_disk, "filler"))
    resume_to_the_end(out, capsys)


def test_full_disk_while_appending_metrics_leaves_no_torn_line(
    tmp_path, tiny_model_dir, small_disk, monkeypatch, capsys
):
    out = os.path.join(small_disk, "run")
    fill_after_checkpoint(monkeypatch, small_disk, 1, lambda f: 0, pad="metrics.jsonl")
    code, err = run_cli(["train", base_config(tmp_path, tiny_model_dir, out)], capsys)
    print(err)
    assert_one_clean_line(
        code, err, "could not write the", os.path.join(out, ""), "the disk is full", f"lmppo train --resume {out}"
    )
    assert "could not write the metrics of iteration 2 (metrics.jsonl)" in err, err
    rows = assert_whole_lines(os.path.join(out, "metrics.jsonl"))  # iteration 2's row: not written at all
    assert [r.get("iteration") for r in rows] == [1, None]
    assert_whole_lines(os.path.join(out, "samples.jsonl"))
    assert storage.temporaries(out) == []
    monkeypatch.undo()
    os.unlink(os.path.join(small_disk, "filler"))
    resume_to_the_end(out, capsys)


def test_full_disk_while_writing_the_final_model(tmp_path, tiny_model_dir, small_disk, monkeypatch, capsys):
    out = os.path.join(small_disk, "run")
    fill_after_checkpoint(monkeypatch, small_disk, 3, lambda f: 8 * 1024)
    code, err = run_cli(["train", base_config(tmp_path, tiny_model_dir, out)], capsys)
    assert_one_clean_line(
        code,
        err,
        "could not write the trained model",
        os.path.join(out, "final"),
        "the disk is full",
        "checkpoint of the last iteration is complete",
    )
    assert not os.path.exists(os.path.join(out, "final")) and storage.temporaries(out) == []
    monkeypatch.undo()
    os.unlink(os.path.join(small_disk, "filler"))
    resume_to_the_end(out, capsys)


def test_full_disk_at_the_start_names_the_config(tmp_path, tiny_model_dir, small_disk, capsys):
    out = os.path.join(small_disk, "run")
    fill(small_disk, 0)
    code, err = run_cli(["train", base_config(tmp_path, tiny_model_dir, out)], capsys)
    assert_one_clean_line(code, err, out, "the disk is full")
    assert storage.temporaries(small_disk) == []


# ----------------------------------------------------------------------------- a file-size limit (no mount needed)

LIMITED = textwrap.dedent("""
    import resource, signal, sys
    sys.path.insert(0, {src!r})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails with EFBIG instead of killing
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    from lmppo.apps.cli import main
    sys.exit(main(sys.argv[2:]))
""")


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="RLIMIT_FSIZE / SIGXFSZ are POSIX-only")
def test_file_size_limit_during_a_real_checkpoint_write(tmp_path, tiny_model_dir):
    """Runs without mount rights: the kernel refuses writes past RLIMIT_FSIZE (EFBIG) in the real writers."""
    out = str(tmp_path / "run")
    weights = os.path.getsize(os.path.join(tiny_model_dir, "model.safetensors"))
    limit = weights // 2  # config, metrics and RNG files fit; the trained weights do not
    assert limit > 64 * 1024, weights
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            LIMITED.format(src=SRC),
            str(limit),
            "train",
            base_config(tmp_path, tiny_model_dir, out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-3000:]
    assert "could not write the checkpoint of iteration 1" in lines[0] and "file size limit" in lines[0], lines
    assert not os.listdir(os.path.join(out, "checkpoints")), "no half-written checkpoint left"
    assert [r["iteration"] for r in read_jsonl(os.path.join(out, "metrics.jsonl"))] == [1]


# ----------------------------------------------------------------------------- two processes, one folder

GATE_REWARD = textwrap.dedent("""
    import os, time

    calls = 0

    def gate(prompts, completions):
        # the second call (iteration 2, after the checkpoint of iteration 1) waits until the test opens the gate
        global calls
        calls += 1
        gate = os.environ.get("GATE")
        if gate and calls == 2:
            open(gate + ".reached", "w").close()
            while not os.path.exists(gate + ".open"):
                time.sleep(0.05)
        return [len(c) / 20.0 for c in completions]
""")


def cli_process(argv, **env) -> subprocess.Popen:
    full_env = dict(
        os.environ,
        PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        **env,
    )
    return subprocess.Popen(
        [sys.executable, "-m", "lmppo.apps.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        preexec_fn=ctrl_c_as_in_a_terminal,
    )


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, list[str]]:
    _out, err = proc.communicate(timeout=timeout)
    return proc.returncode, [ln for ln in err.splitlines() if ln.strip()]


def wait_for_file(path: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, finish(proc)
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def gated_config(tmp_path, tiny_model_dir, out: str) -> str:
    (tmp_path / "gate_reward.py").write_text(GATE_REWARD)
    return base_config(
        tmp_path,
        tiny_model_dir,
        out,
        reward__sources=[{"kind": "function", "path": f"{tmp_path / 'gate_reward.py'}:gate"}],
    )


@pytest.mark.slow
def test_second_process_is_refused_while_a_run_holds_the_folder_and_a_dead_holder_is_taken_over(
    tmp_path, tiny_model_dir
):
    out = str(tmp_path / "run")
    cfg = gated_config(tmp_path, tiny_model_dir, out)
    gate = str(tmp_path / "gate")
    first = cli_process(["train", cfg], GATE=gate)
    try:
        wait_for_file(gate + ".reached", first)  # iteration 1 checkpointed, iteration 2 under way
        second, resumed = cli_process(["train", cfg, "--overwrite", "true"]), cli_process(["train", "--resume", out])
        for proc in (second, resumed):
            code, lines = finish(proc)
            assert code == 2 and len(lines) == 1, lines
            assert lines[0].startswith(f"error: output_dir {out} is in use by process {first.pid} on host "), lines
        assert first.poll() is None
    finally:  # the holder waits at its gate for ever: it dies here, whatever the assertions said
        first.send_signal(signal.SIGKILL)  # the holder dies: its lock is stale
        first.wait(timeout=60)
    assert [r["iteration"] for r in read_jsonl(os.path.join(out, "metrics.jsonl"))] == [1]
    code, lines = finish(cli_process(["train", "--resume", out]))
    assert code == 0, lines
    assert [r["iteration"] for r in assert_whole_lines(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3]


@pytest.mark.slow
def test_two_runs_started_at_once_into_one_folder(tmp_path, tiny_model_dir):
    out = str(tmp_path / "run")
    cfg = base_config(tmp_path, tiny_model_dir, out, iterations=2)
    procs = [cli_process(["train", cfg]) for _ in range(2)]
    results = [finish(p) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(lines for code, lines in results if code == 2)
    assert len(loser) == 1 and ("is in use by process" in loser[0] or "already holds a run" in loser[0]), loser
    assert [r["iteration"] for r in assert_whole_lines(os.path.join(out, "metrics.jsonl"))] == [1, 2]


HOLDER_WRITES_LATE = """
import fcntl, json, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
open(sys.argv[1] + ".taken", "w").close()
time.sleep(0.5)  # the lock is held, its record not yet written: the window the loser of a race reads in
os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
sys.stdin.read()
"""


def test_a_holder_that_writes_its_record_late_is_still_named(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    lock_file = str(out / lock.LOCK_NAME)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER_WRITES_LATE, lock_file], stdin=subprocess.PIPE)
    try:
        wait_for_file(lock_file + ".taken", holder)
        with pytest.raises(RunLockedError, match=f"is in use by process {holder.pid} on host "):
            lock.acquire(str(out))
    finally:
        holder.communicate(timeout=60)


# ----------------------------------------------------------------------------- broken model folders


def _truncate(path: str) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)


BROKEN_FOLDERS = {
    # name: (how to break a copy of the tiny model folder, what the message must name)
    "truncated model.safetensors": (
        lambda d: _truncate(os.path.join(d, "model.safetensors")),
        ["model.safetensors", "is truncated or corrupt"],
    ),
    "empty model.safetensors": (
        lambda d: open(os.path.join(d, "model.safetensors"), "wb").close(),
        ["model.safetensors", "is empty"],
    ),
    "garbage model.safetensors": (
        lambda d: open(os.path.join(d, "model.safetensors"), "wb").write(os.urandom(4096)),
        ["model.safetensors", "not a safetensors file"],
    ),
    "invalid config.json": (
        lambda d: open(os.path.join(d, "config.json"), "w").write('{"model_type": '),
        ["config.json", "is not valid JSON"],
    ),
    "no config.json": (lambda d: os.unlink(os.path.join(d, "config.json")), ["config.json", "is missing"]),
    "no weights file": (
        lambda d: os.unlink(os.path.join(d, "model.safetensors")),
        ["model.safetensors", "no weights file"],
    ),
    "no tokenizer.json": (lambda d: os.unlink(os.path.join(d, "tokenizer.json")), ["tokenizer.json", "is missing"]),
    "invalid tokenizer.json": (
        lambda d: open(os.path.join(d, "tokenizer.json"), "w").write("[1, 2"),
        ["tokenizer.json", "is not valid JSON"],
    ),
}


@pytest.mark.parametrize("case", list(BROKEN_FOLDERS))
def test_broken_model_folder_is_one_line_naming_folder_and_file(tmp_path, tiny_model_dir, capsys, case):
    broken = str(tmp_path / "model")
    shutil.copytree(tiny_model_dir, broken)
    breaker, names = BROKEN_FOLDERS[case]
    breaker(broken)
    code, err = run_cli(["train", base_config(tmp_path, broken, str(tmp_path / "run"))], capsys)
    assert_one_clean_line(code, err, broken, *names)


@pytest.mark.parametrize("case", ["truncated model.safetensors", "invalid config.json"])
def test_broken_reward_model_folder_is_one_line(tmp_path, tiny_model_dir, tiny_reward_model_dir, capsys, case):
    broken = str(tmp_path / "rm")
    shutil.copytree(tiny_reward_model_dir, broken)
    breaker, names = BROKEN_FOLDERS[case]
    breaker(broken)
    cfg = base_config(
        tmp_path, tiny_model_dir, str(tmp_path / "run"), reward__sources=[{"kind": "model", "path": broken}]
    )
    assert_one_clean_line(*run_cli(["train", cfg], capsys), broken, *names)


# ----------------------------------------------------------------------------- a kill while pruning

PRUNE_AND_STALL = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {src!r})
    import lmppo.run.storage as storage
    from lmppo.run.manifest import prune_checkpoints
    real_unlink = os.unlink
    count = [0]

    def unlink_then_stall(path, *args, **kwargs):  # the deletion is real; after 3 files the process stalls
        real_unlink(path, *args, **kwargs)
        count[0] += 1
        if count[0] == 3:
            open(sys.argv[2], "w").close()
            time.sleep(600)

    os.unlink = unlink_then_stall
    prune_checkpoints(sys.argv[1], 1, os.path.join(sys.argv[1], "checkpoints", "iter-00000003"))
""")


def fake_checkpoint(run: str, iteration: int) -> str:
    from lmppo.run.manifest import write_manifest

    folder = os.path.join(run, "checkpoints", f"iter-{iteration:08d}")
    os.makedirs(folder)
    for name in ("state.json", "trained.safetensors", "optimizer.pt", "rng-rank0.json", "rng-rank0.safetensors"):
        with open(os.path.join(folder, name), "wb") as fh:
            fh.write(os.urandom(1000))
    write_manifest(folder, iteration)
    return folder


def test_a_kill_while_pruning_never_leaves_a_half_removed_checkpoint_under_its_name(tmp_path):
    from lmppo.run.folder import list_checkpoints
    from lmppo.run.manifest import prune_checkpoints, verify_checkpoint

    run = str(tmp_path / "run")
    for i in (1, 2, 3):
        fake_checkpoint(run, i)
    marker = str(tmp_path / "stalled")
    proc = subprocess.Popen([sys.executable, "-c", PRUNE_AND_STALL.format(src=SRC), run, marker])
    try:
        wait_for_file(marker, proc, timeout=120)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    for _i, path in list_checkpoints(run):
        verify_checkpoint(path)  # whatever is under a checkpoint's own name is complete
    prune_checkpoints(run, 1, os.path.join(run, "checkpoints", "iter-00000003"))  # the next prune cleans up
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["iter-00000003"]


def test_a_torn_last_line_left_by_a_kill_is_cut_before_the_next_append(tmp_path):
    from lmppo.training.metrics import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1}\n{"iteration": 2, "objective/kl": 0.1')  # a kill in the middle of a row
    logger = MetricsLogger(str(tmp_path), [], append=True)
    logger.log({"iteration": 2, "objective/kl": 0.2}, 16)
    logger.close()
    assert path.read_text() == '{"iteration": 1}\n{"iteration": 2, "objective/kl": 0.2}\n'


# ----------------------------------------------------------------------------- console noise


def test_a_plain_run_prints_no_library_noise(tmp_path, tiny_model_dir):
    """No DeepSpeed accelerator notice, deprecation warning or progress bar of a library: nothing a user cannot act
    on (--debug shows them)."""
    proc = cli_process(["train", base_config(tmp_path, tiny_model_dir, str(tmp_path / "run"), iterations=1)])
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    text = out + err
    for noise in ("Setting accelerator", "FutureWarning", "DeprecationWarning", "it/s]", "deprecated"):
        assert noise not in text, (noise, text[-3000:])
