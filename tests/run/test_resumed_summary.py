"""After a resume the summary covers the whole run (metrics.jsonl from iteration 1), and a metrics.jsonl cut by hand
is named in one warning on resume (real runs through the CLI, the file edited for real)."""

from __future__ import annotations

import json
import os

import pytest
from test_real_faults import base_config, run_cli

from lmppo.apps.cli import main
from lmppo.run import metrics_file


def summary(out: str) -> dict:
    with open(os.path.join(out, "summary.json")) as fh:
        return json.load(fh)["training"]


def test_a_resumed_run_summarises_from_iteration_1_and_names_lost_rows(tmp_path, tiny_model_dir, capsys):
    out = str(tmp_path / "run")
    cfg = base_config(tmp_path, tiny_model_dir, out, iterations=2)
    assert run_cli(["train", cfg], capsys)[0] == 0

    capsys.readouterr()
    assert main(["train", "--resume", out, "--total_episodes", "16"]) == 0  # iterations 3, 4
    printed = capsys.readouterr().out
    t = summary(out)
    assert t["first"]["iteration"] == 1 and t["last"]["iteration"] == 4, t
    assert "iteration 1 -> 4" in printed, printed

    assert main(["train", "--resume", out]) == 0  # already complete: no iteration runs, the summary is whole
    t = summary(out)
    assert t["first"]["iteration"] == 1 and t["last"]["iteration"] == 4, t

    path = os.path.join(out, "metrics.jsonl")
    with open(path) as fh:
        lines = fh.read().splitlines()
    with open(path, "w") as fh:  # by hand: the row of iteration 2 deleted, the last one cut in the middle
        fh.write("\n".join([lines[0], lines[2], lines[3][: len(lines[3]) // 2]]))
    assert metrics_file.lost_rows(out, 4).startswith("metrics.jsonl lacks the rows of iterations 2, 4 of the 4")
    with pytest.warns(UserWarning, match=r"lacks the rows of iterations 2, 4 .*1 unreadable line") as caught:
        code, err = run_cli(["train", "--resume", out, "--total_episodes", "20"], capsys)
    assert code == 0, err
    assert len([w for w in caught if "metrics.jsonl" in str(w.message)]) == 1
    t = summary(out)
    assert t["first"]["iteration"] == 1 and t["last"]["iteration"] == 5, t


def test_lost_rows_in_words(tmp_path):
    out = str(tmp_path)
    assert metrics_file.lost_rows(out, 3) == "metrics.jsonl is missing: the rows of iterations 1-3 are lost"
    with open(os.path.join(out, "metrics.jsonl"), "w") as fh:
        fh.write("".join(json.dumps({"iteration": i}) + "\n" for i in (1, 2, 6, 7)))
    assert metrics_file.lost_rows(out, 2) == ""
    assert metrics_file.lost_rows(out, 7).startswith("metrics.jsonl lacks the rows of iterations 3-5 of the 7 ")
    assert [r["iteration"] for r in metrics_file.run_rows(out, 6)] == [1, 2, 6]
