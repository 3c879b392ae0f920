"""`lmppo train` refuses a bad prompt file in one line before any model loads: a ragged CSV (the file and the first
bad line), a FIFO (refused without being opened: reading one with no writer blocks forever)."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from cli_support import assert_one_clean_line, changed, env, run_cli, write  # noqa: F401  (env: a fixture)
from conftest import REPO


def test_a_ragged_csv_is_one_line_naming_the_file_and_the_first_bad_line(env, capsys):
    tmp_path, base = env
    prompts = write(tmp_path, "p.csv", text='id,prompt\n1,the movie was\n2,"this, film"\n\n3,my friend,felt\n4,x,y,z\n')
    code, err = run_cli(["train", write(tmp_path, "c.yaml", data=changed(base, data__prompts=prompts))], capsys)
    assert_one_clean_line(code, err, "p.csv, line 5: the row has 3 fields, the header has 2")
    assert not os.path.exists(base["output_dir"])  # refused before the run folder was made or a model loaded


def test_a_fifo_as_the_prompts_file_is_refused_at_once(env):
    tmp_path, base = env
    fifo = tmp_path / "prompts.txt.fifo"
    os.mkfifo(fifo)
    cfg = write(tmp_path, "c.yaml", data=changed(base, data__prompts=str(fifo), data__format="text"))
    proc = subprocess.run(  # a real process with a deadline: a regression would block, not fail
        [sys.executable, "-m", "lmppo", "train", cfg],
        env={**os.environ, "PYTHONPATH": os.path.join(REPO, "src")},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and lines[-1].startswith("error: config field `data.prompts`"), proc.stderr[-2000:]
    assert "is a FIFO (named pipe), not a regular file" in lines[-1]
    assert not os.path.exists(base["output_dir"])
    assert yaml.safe_load(open(cfg))["data"]["prompts"] == str(fifo)
