"""Commands that write results (issue 41, cases 5, 7, 8): `lmppo eval` on a run in a real read-only file system is
refused before the work with one line; `lmppo merge` stopped by a real SIGTERM / Ctrl-C says what happened and what
to do (not `lmppo train --resume`), leaves no temporary, and a SIGKILLed merge's full-size temporary is removed by
the next `lmppo merge` of the same output."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from test_real_faults import base_config, cli_process, finish, wait_for_file

from conftest import REPO, ctrl_c_as_in_a_terminal, tiny_llama

SRC = os.path.join(REPO, "src")

# the real `lmppo merge`, held (by a sleep) after its first weight file is written into its temporary folder
HOLD_MERGE = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {src!r})
    import lmppo.apps.merge as merge

    real = merge.save_file

    def held(*args, **kwargs):
        real(*args, **kwargs)
        open(os.environ["GATE"] + ".reached", "w").close()
        time.sleep(600)

    merge.save_file = held
    from lmppo.apps.cli import main
    sys.exit(main())
""")


def _models(tmp_path, tokenizer) -> list[str]:
    folders = []
    for seed in (0, 1):
        path = tmp_path / f"model-{seed}"
        tiny_llama(tokenizer, seed=seed).save_pretrained(path)
        tokenizer.save_pretrained(path)
        folders.append(str(path))
    return folders


def _held_merge(tmp_path, argv: list[str]) -> tuple[subprocess.Popen, str]:
    gate = str(tmp_path / "gate")
    script = tmp_path / "held_merge.py"
    script.write_text(HOLD_MERGE.format(src=SRC))
    env = dict(os.environ, PYTHONPATH=SRC, HF_HUB_OFFLINE="1", GATE=gate)
    proc = subprocess.Popen(
        [sys.executable, str(script), "merge", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=ctrl_c_as_in_a_terminal,
    )
    return proc, gate


def _left(output: str) -> list[str]:
    parent, name = os.path.split(os.path.abspath(output))
    return sorted(glob.glob(os.path.join(parent, f".{name}.*")))


@pytest.mark.parametrize(
    "signum,code,how", [(signal.SIGTERM, 143, "terminated (SIGTERM)"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_stopped_merge_says_so_and_leaves_no_temporary(tmp_path, tokenizer, signum, code, how):
    a, b = _models(tmp_path, tokenizer)
    output = str(tmp_path / "merged")
    proc, gate = _held_merge(tmp_path, [a, b, "--output", output])
    wait_for_file(gate + ".reached", proc)
    assert _left(output)  # its temporary, with a weight file in it, exists now
    proc.send_signal(signum)
    rc, lines = finish(proc)
    assert rc == code and len(lines) == 1, (rc, lines)
    assert lines[0] == (
        f"{how}; the merged model was not written (its temporary is removed); run the same `lmppo merge` command again"
    )
    assert "lmppo train" not in lines[0]
    assert _left(output) == [] and not os.path.exists(output)
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))  # the inputs untouched


def test_a_killed_merges_temporary_is_removed_by_the_next_merge(tmp_path, tokenizer):
    a, b = _models(tmp_path, tokenizer)
    output = str(tmp_path / "merged")
    proc, gate = _held_merge(tmp_path, [a, b, "--output", output])
    wait_for_file(gate + ".reached", proc)
    proc.kill()  # SIGKILL: nothing can clean up
    proc.wait()
    left = _left(output)
    assert any(".merged.tmp-" in p for p in left), left
    rc, lines = finish(cli_process(["merge", a, b, "--output", output]))
    assert rc == 0, lines
    assert _left(output) == [] and os.path.isfile(os.path.join(output, "model.safetensors"))


@pytest.fixture()
def read_only_disk(tmp_path):
    """A real tmpfs, mounted read-write for the run and then remounted read-only; skipped where mounting is not
    allowed."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")

    def remount_read_only() -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)

    yield str(mnt), remount_read_only
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_eval_of_a_run_on_a_read_only_disk_is_refused_before_the_work(tmp_path, tiny_model_dir, read_only_disk):
    disk, remount_read_only = read_only_disk
    run = os.path.join(disk, "run")
    rc, lines = finish(cli_process(["train", base_config(tmp_path, tiny_model_dir, run, iterations=1)]))
    assert rc == 0, lines
    before = sorted(os.listdir(run))
    remount_read_only()
    proc = cli_process(["eval", run, "--num-prompts", "2", "--samples-per-prompt", "1"])
    out, err = proc.communicate(timeout=600)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, lines)
    assert lines[0] == (
        f"error: cannot write the evaluation (eval.json) to {run}/eval.json: the file system is read-only ({run}); "
        "nothing was done: give another output path or make it writable"
    )
    assert "score" not in out  # refused before any model was loaded or sampled
    assert sorted(os.listdir(run)) == before
    # the way out the line gives works: another output path
    rc, lines = finish(
        cli_process(["eval", run, "--num-prompts", "2", "--samples-per-prompt", "1", "-o", str(tmp_path / "e.json")])
    )
    assert rc == 0, lines
    assert os.path.isfile(tmp_path / "e.json")
