"""Ownership by default-deny (issue 41, cases 4 and 9): a file is lmppo's only when a record lmppo wrote names it.
A run folder whose ownership record has no listing of final/ (an older lmppo) or was copied from another run keeps
`final/thesis.pdf` through `--overwrite true`, named in the warning; run sub-folders that are links to another disk
are followed and kept, never replaced. Real runs through the CLI, real files, real links."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from test_real_faults import base_config, run_cli

import lmppo.run.ownership as ownership
import lmppo.run.storage as storage
from train_worker import read_jsonl


def _record(out: str) -> dict:
    with open(os.path.join(out, ownership.OWNED)) as fh:
        return json.load(fh)


def _write_record(out: str, data: dict) -> None:
    with open(os.path.join(out, ownership.OWNED), "w") as fh:
        json.dump(data, fh)


@pytest.mark.parametrize("record", ["older lmppo (no listing of final/)", "copied from another run"])
def test_overwrite_keeps_a_file_no_record_names(tmp_path, tiny_model_dir, capsys, record):
    out = str(tmp_path / "run")
    cfg = base_config(tmp_path, tiny_model_dir, out, iterations=1)
    assert run_cli(["train", cfg], capsys)[0] == 0
    thesis = os.path.join(out, "final", "thesis.pdf")
    with open(thesis, "wb") as fh:
        fh.write(b"%PDF-1.7 my thesis")
    if record.startswith("older"):
        _write_record(out, {"files": _record(out)["files"]})  # no `inside`: nothing in final/ is named as lmppo's
    else:
        other = str(tmp_path / "other")
        assert run_cli(["train", base_config(tmp_path, tiny_model_dir, other, iterations=1)], capsys)[0] == 0
        shutil.copy(os.path.join(other, ownership.OWNED), os.path.join(out, ownership.OWNED))
    with pytest.warns(UserWarning, match="lmppo did not write") as caught:
        code, err = run_cli(["train", cfg, "--overwrite", "true"], capsys)
    assert code == 0, err
    with open(thesis, "rb") as fh:
        assert fh.read() == b"%PDF-1.7 my thesis"
    assert any(thesis in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert os.path.isfile(os.path.join(out, "final", "policy", "model.safetensors"))  # the new run's model
    assert storage.temporaries(out) == []


def test_linked_checkpoints_and_final_are_followed_and_kept(tmp_path, tiny_model_dir, capsys):
    big = tmp_path / "bigdisk"
    (big / "ckpts").mkdir(parents=True)
    (big / "final").mkdir()
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(big / "ckpts", out / "checkpoints")  # set up before the first run
    os.symlink(big / "final", out / "final")
    cfg = base_config(tmp_path, tiny_model_dir, str(out), iterations=2)
    code, err = run_cli(["train", cfg], capsys)
    assert code == 0, err  # an empty linked folder holds no run
    assert os.path.islink(out / "checkpoints") and os.path.islink(out / "final")
    assert sorted(os.listdir(big / "ckpts")) == ["iter-00000001", "iter-00000002"]
    assert os.path.isfile(big / "final" / "policy" / "model.safetensors")
    (big / "ckpts" / "NOTES.txt").write_text("keep me")

    code, err = run_cli(["train", cfg], capsys)  # the advice of "already holds a run" works with the links
    assert code == 2 and "--overwrite true" in err, err
    with pytest.warns(UserWarning, match="NOTES.txt"):
        code, err = run_cli(["train", cfg, "--overwrite", "true"], capsys)
    assert code == 0, err
    assert os.path.islink(out / "checkpoints") and os.path.islink(out / "final")  # links kept, not replaced
    assert sorted(os.listdir(big / "ckpts")) == ["NOTES.txt", "iter-00000001", "iter-00000002"]
    assert (big / "ckpts" / "NOTES.txt").read_text() == "keep me"
    assert os.path.isfile(big / "final" / "policy" / "model.safetensors")
    assert [r["iteration"] for r in read_jsonl(str(out / "metrics.jsonl"))] == [1, 2]

    code, err = run_cli(["train", "--resume", str(out), "--total_episodes", "12"], capsys)
    assert code == 0, err
    assert os.path.islink(out / "final") and os.path.isfile(big / "final" / "policy" / "model.safetensors")
    assert storage.temporaries(str(out)) == [] and not [
        n for n in os.listdir(tmp_path / "bigdisk") if n.startswith(".")
    ]
