"""`lmppo.run.outputs`: a result's place checked writable for real (a read-only tmpfs), one writer at a time, and the
temporaries of a killed writer of the same result removed."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import lmppo.run.lock as lock
from lmppo.errors import RunLockedError, StorageError
from lmppo.run.outputs import check_writable, remove_stale, result_output


@pytest.fixture()
def read_only(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_read_only_place_is_refused_naming_it_and_a_writable_one_is_left_as_it_was(tmp_path, read_only):
    with pytest.raises(StorageError, match=r"cannot write the result to .*/ro/a/b.json: the file system is read-only"):
        check_writable(os.path.join(read_only, "a", "b.json"), "the result")
    check_writable(str(tmp_path / "new" / "deeper" / "out.json"), "the result")  # its nearest existing parent
    assert sorted(os.listdir(tmp_path)) == ["ro"]  # the probe left nothing


def test_stale_temporaries_of_that_name_only_are_removed(tmp_path):
    for name in (".merged.tmp-0123abcd", ".merged.old-89abcdef", ".other.tmp-0123abcd", "merged.tmp", ".merged.tmp-x"):
        (tmp_path / name).mkdir()
    removed = remove_stale(str(tmp_path / "merged"))
    assert sorted(os.path.basename(p) for p in removed) == [".merged.old-89abcdef", ".merged.tmp-0123abcd"]
    assert sorted(os.listdir(tmp_path)) == [".merged.tmp-x", ".other.tmp-0123abcd", "merged.tmp"]


def test_one_writer_at_a_time_and_no_lock_file_left(tmp_path):
    out = str(tmp_path / "merged")
    (tmp_path / ".merged.tmp-0123abcd").mkdir()  # a killed writer's
    with result_output(out, "the merged policy", "`lmppo merge`"):
        assert not os.path.exists(tmp_path / ".merged.tmp-0123abcd")
        assert os.path.exists(tmp_path / ".merged.lock")
        pid = os.fork()
        if pid == 0:  # another process: refused while this one writes
            try:
                with result_output(out, "the merged policy", "`lmppo merge`"):
                    os._exit(1)
            except RunLockedError:
                os._exit(0)
            os._exit(2)
        assert os.waitpid(pid, 0)[1] == 0
    assert sorted(os.listdir(tmp_path)) == []


def test_into_a_run_it_takes_the_runs_lock(tmp_path):
    run = str(tmp_path / "run")
    os.makedirs(run)
    with result_output(os.path.join(run, "eval.json"), "the evaluation", "`lmppo eval`", run_dir=run):
        assert lock.holder(run) is not None
    assert lock.holder(run) is None and not os.path.exists(os.path.join(run, lock.LOCK_NAME))


def test_a_run_in_use_is_refused_with_advice_for_the_command(tmp_path):
    run = str(tmp_path / "run")
    os.makedirs(run)
    pid = os.fork()
    if pid == 0:  # another process holds the run (a training)
        lock.acquire(run)
        open(os.path.join(tmp_path, "held"), "w").close()
        import time

        time.sleep(30)
        os._exit(0)
    try:
        while not os.path.exists(tmp_path / "held"):
            pass
        with pytest.raises(
            RunLockedError, match=r"`lmppo eval` writes .*eval.json, but the run .* is in use by process"
        ):
            with result_output(os.path.join(run, "eval.json"), "the evaluation", "`lmppo eval`", run_dir=run):
                pass
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
