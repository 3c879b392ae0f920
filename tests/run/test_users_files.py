"""lmppo removes or replaces only the files it wrote: a file of the user's inside final/, checkpoints/ or a checkpoint
is kept where it is (real runs through the CLI, real files added by hand)."""

from __future__ import annotations

import os

import pytest
from test_real_faults import base_config, run_cli

import lmppo.run.ownership as ownership
import lmppo.run.storage as storage
from train_worker import read_jsonl


def write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)


def read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def test_overwrite_and_resume_keep_the_users_files(tmp_path, tiny_model_dir, capsys):
    out = str(tmp_path / "run")
    cfg = base_config(tmp_path, tiny_model_dir, out, iterations=2)
    assert run_cli(["train", cfg], capsys)[0] == 0
    results, notes = (
        os.path.join(out, "final", "policy", "my_eval_results.md"),
        os.path.join(out, "checkpoints", "NOTES.txt"),
    )
    write(results, "win rate 0.61\n")
    write(notes, "iter 2 looked best\n")
    assert sorted(ownership.foreign_files(os.path.join(out, "final"))) == ["policy/my_eval_results.md"]
    assert ownership.foreign_files(os.path.join(out, "checkpoints")) == ["NOTES.txt"]

    with pytest.warns(UserWarning, match="kept 2 file\\(s\\) lmppo did not write") as caught:
        code, err = run_cli(["train", cfg, "--overwrite", "true"], capsys)
    assert code == 0, err
    assert read(results) == "win rate 0.61\n" and read(notes) == "iter 2 looked best\n"
    named = str(caught[0].message)
    assert results in named and notes in named, named
    assert [r["iteration"] for r in read_jsonl(os.path.join(out, "metrics.jsonl"))] == [1, 2]  # a new run
    assert os.path.isfile(os.path.join(out, "final", "policy", "model.safetensors"))
    assert ownership.foreign_files(os.path.join(out, "final")) == ["policy/my_eval_results.md"]  # still not ours

    code, err = run_cli(["train", cfg, "--overwrite", "true"], capsys)  # again: still kept, still named
    assert code == 0 and read(results) == "win rate 0.61\n" and read(notes) == "iter 2 looked best\n", err

    code, err = run_cli(["train", "--resume", out, "--total_episodes", "16"], capsys)  # final/ is replaced
    assert code == 0, err
    assert read(results) == "win rate 0.61\n" and read(notes) == "iter 2 looked best\n"
    assert storage.temporaries(out) == []


def test_a_pruned_checkpoint_holding_a_users_file_is_kept(tmp_path, tiny_model_dir, capsys):
    out = str(tmp_path / "run")
    cfg = base_config(tmp_path, tiny_model_dir, out, iterations=2, checkpoint__keep_last=1)
    assert run_cli(["train", cfg], capsys)[0] == 0
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["iter-00000002"]
    mine = os.path.join(out, "checkpoints", "iter-00000002", "loss_curve.png")
    write(mine, "png")
    code, err = run_cli(["train", "--resume", out, "--total_episodes", "16"], capsys)
    assert code == 0, err
    assert read(mine) == "png"  # iter-2 would have been pruned (keep_last 1): kept with the file
    assert "iter-00000004" in os.listdir(os.path.join(out, "checkpoints"))


def test_removal_keeps_foreign_files_and_lists_nothing_as_ours(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    ownership.claim(str(out))
    final = out / "final"
    write(str(final / "policy" / "model.safetensors"), "w")
    write(str(final / "value" / "value_head.safetensors"), "v")
    ownership.write_listing(str(final))
    write(str(final / "policy" / "notes.md"), "mine")
    write(str(final / "extra" / "plot.png"), "mine too")
    assert sorted(ownership.foreign_files(str(final))) == ["extra/plot.png", "policy/notes.md"]
    kept = ownership.remove_keeping(str(final), "final")
    assert sorted(kept) == ["extra/plot.png", "policy/notes.md"]
    assert sorted(os.path.relpath(os.path.join(r, f), final) for r, _d, fs in os.walk(final) for f in fs) == [
        "extra/plot.png",
        "policy/notes.md",
    ]
    assert ownership.own_files(str(final)) == set() and storage.temporaries(str(out)) == []
    # a folder of lmppo's holding only its own files goes as a whole
    write(str(final / "policy" / "model.safetensors"), "w")
    ownership.write_listing(str(final), ["policy/model.safetensors"])
    assert sorted(ownership.remove_keeping(str(final), "final")) == ["extra/plot.png", "policy/notes.md"]
    assert not (final / "policy" / "model.safetensors").exists()
