"""Every error's advice is a command that works in that state, and torch.save's hidden errno is named: real
file-size limits (RLIMIT_FSIZE in a subprocess) and a real full tmpfs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from test_real_faults import (
    LIMITED,
    SRC,
    base_config,
    cli_process,
    fill_after_checkpoint,
    finish,
    run_cli,
)

import lmppo.run.storage as storage
from conftest import tiny_llama
from train_worker import read_jsonl

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="RLIMIT_FSIZE / SIGXFSZ are POSIX-only")


def limited(limit: int, argv: list[str]) -> tuple[int, list[str]]:
    env = dict(os.environ, PYTHONPATH=SRC, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [sys.executable, "-c", LIMITED.format(src=SRC), str(limit), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    return done.returncode, [ln for ln in done.stderr.splitlines() if ln.strip()]


def test_first_checkpoint_fails_the_advice_is_overwrite_and_every_message_after_agrees(tmp_path, tiny_model_dir):
    out = str(tmp_path / "run")
    cfg = base_config(tmp_path, tiny_model_dir, out)
    weights = os.path.getsize(os.path.join(tiny_model_dir, "model.safetensors"))
    code, lines = limited(weights // 2, ["train", cfg])  # the trained weights of iteration 1 do not fit
    assert code == 2 and len(lines) == 1, lines
    assert "could not write the checkpoint of iteration 1" in lines[0] and "file size limit" in lines[0], lines
    assert "--resume" not in lines[0] and "`--overwrite true`" in lines[0], lines

    code, lines = finish(cli_process(["train", cfg]))  # a plain rerun: no --resume advice either
    assert code == 2 and len(lines) == 1 and "already holds a run" in lines[0], lines
    assert "--resume" not in lines[0] and "`--overwrite true`" in lines[0], lines
    code, lines = finish(cli_process(["train", "--resume", out]))
    assert code == 2 and len(lines) == 1 and "no complete checkpoint" in lines[0], lines
    assert "`--overwrite true`" in lines[0], lines
    code, lines = finish(cli_process(["train", cfg, "--overwrite", "true"]))  # the advice works
    assert code == 0, lines
    assert [r["iteration"] for r in read_jsonl(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3]


def test_torch_save_over_the_file_size_limit_is_named(tmp_path, tiny_model_dir):
    out = str(tmp_path / "run")
    weights = os.path.getsize(os.path.join(tiny_model_dir, "model.safetensors"))
    # trained.safetensors (the weights) fits, optimizer.pt (two moments per weight) does not: torch.save fails
    code, lines = limited(weights * 3 // 2, ["train", base_config(tmp_path, tiny_model_dir, out)])
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "file size limit" in lines[0] and "RuntimeError" not in lines[0] and "enforce" not in lines[0], lines
    assert storage.temporaries(out) == []


@pytest.fixture()
def disk_32m(tmp_path):
    """A real 32 MiB tmpfs; skipped where mounting is not allowed."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_torch_save_on_a_full_disk_says_the_disk_is_full(tmp_path, tokenizer, disk_32m, monkeypatch, capsys):
    model_dir = str(tmp_path / "wider")  # 1.7 MB of weights: removing the failed checkpoint frees more than 1 MiB
    tiny_llama(tokenizer, hidden=128).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = os.path.join(disk_32m, "run")
    trained = lambda folder: os.path.getsize(os.path.join(folder, "trained.safetensors")) + 256 * 1024  # noqa: E731
    fill_after_checkpoint(monkeypatch, disk_32m, 1, trained)
    cfg = base_config(tmp_path, model_dir, out, log__sample_every=0, checkpoint__keep_last=1)
    code, err = run_cli(["train", cfg], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "could not write the checkpoint of iteration 2" in err and "the disk is full" in err, err
    assert "RuntimeError" not in err and f"`lmppo train --resume {out}`" in err, err
