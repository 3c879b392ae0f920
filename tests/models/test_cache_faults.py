"""lmppo's cache on a real read-only file system, and a real full one during the SmolLM2 conversion (issue 41, cases
6 and 11): one `error:` line naming the cache and what to do, never an OSError traceback or safetensors' raw
`SafetensorError ... os error 28`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.fixture()
def tmpfs(tmp_path):
    mounted = []

    def mount(options: str) -> str:
        mnt = tmp_path / f"cache-{len(mounted)}"
        mnt.mkdir()
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a tmpfs needs root")
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(mnt)
        return str(mnt)

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _train(tmp_path, cache: str) -> tuple[int, list[str]]:
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "src"), LMPPO_CACHE=cache, HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmppo.apps.cli",
            "train",
            "--total_episodes",
            "32",
            "--output_dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    return done.returncode, [ln for ln in done.stderr.splitlines() if ln.strip()]


def test_a_read_only_cache_is_one_line(tmp_path, tmpfs):
    cache = tmpfs("size=1m,ro")
    code, lines = _train(tmp_path, cache)
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in "\n".join(lines), lines
    assert errors[0].startswith(f"error: cannot write lmppo's cache {cache}")
    assert "the file system is read-only; set LMPPO_CACHE to a writable folder" in errors[0]


def test_a_cache_that_fills_up_during_the_conversion_is_one_line(tmp_path, tmpfs):
    cache = tmpfs("size=48m")  # the converted SmolLM2 needs about 520 MB
    code, lines = _train(tmp_path, cache)
    errors = [ln for ln in lines if ln.startswith("error:")]
    text = "\n".join(lines)
    assert code == 2 and len(errors) == 1, lines
    assert "Traceback" not in text and "SafetensorError" not in text and "os error" not in text, text
    assert "into lmppo's cache" in errors[0] and "the disk is full" in errors[0] and "LMPPO_CACHE" in errors[0]
    assert [n for n in os.listdir(cache) if not n.startswith(".")] in ([], ["models"])  # no half-written model
    assert (
        not any(".tmp-" in n for n in os.listdir(os.path.join(cache, "models")))
        if os.path.isdir(os.path.join(cache, "models"))
        else True
    )
