"""Inputs fingerprinted (issue 41, cases 3 and 10): a prompt file shuffled in place under a stopped run is refused on
resume with one line naming it and the flag that accepts it; a model folder moved with identical files is accepted
by content, one changed in content is refused. Real files, the real `lmppo train` command (in-process)."""

from __future__ import annotations

import json
import os
import shutil

import yaml

from cli_support import env, run_cli  # noqa: F401 - `env` is a fixture
from lmppo.apps.cli import main
from lmppo.training.inputs import fingerprint_folder, fingerprint_records


def _latest_state(run: str) -> dict:
    folder = sorted(os.listdir(os.path.join(run, "checkpoints")))[-1]
    with open(os.path.join(run, "checkpoints", folder, "state.json"), encoding="utf-8") as fh:
        return json.load(fh)


def _config(tmp_path, base: dict, **changes) -> str:
    cfg = {**base, "total_episodes": 8, "checkpoint": {"every": 1}, **changes}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_fingerprints_follow_content_not_names_or_places(tmp_path):
    assert fingerprint_records(["a", "b"]) != fingerprint_records(["b", "a"])  # a shuffle is a change
    assert fingerprint_records(["a", "b"]) == fingerprint_records(["a", "b"])
    (tmp_path / "m1").mkdir()
    (tmp_path / "m1" / "config.json").write_text("{}")
    (tmp_path / "m1" / "model.safetensors").write_bytes(b"\x00" * 64)
    shutil.copytree(tmp_path / "m1", tmp_path / "m2")
    (tmp_path / "m2" / "README.md").write_text("my notes")  # not part of the model
    assert fingerprint_folder(str(tmp_path / "m1")) == fingerprint_folder(str(tmp_path / "m2"))
    (tmp_path / "m2" / "model.safetensors").write_bytes(b"\x00" * 63 + b"\x01")
    assert fingerprint_folder(str(tmp_path / "m1")) != fingerprint_folder(str(tmp_path / "m2"))


def test_a_prompt_file_shuffled_under_a_stopped_run_is_refused_then_accepted_with_the_flag(env, capsys):  # noqa: F811
    tmp_path, base = env
    cfg = _config(tmp_path, base)
    run = base["output_dir"]
    code, err = run_cli(["train", cfg], capsys)
    assert code == 0, err
    recorded = _latest_state(run)["inputs"]["data.prompts"]
    prompts = tmp_path / "prompts.txt"
    lines = prompts.read_text().splitlines()
    prompts.write_text("\n".join(reversed(lines)) + "\n")  # shuffled in place, same line count
    code, err = run_cli(["train", "--resume", run, "--total_episodes", "12"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: config field `data.prompts`"), err
    assert "--accept-changed-inputs" in err and "differs from what the checkpoint" in err
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["iter-00000001", "iter-00000002"]  # untouched
    code, err = run_cli(["train", "--resume", run, "--total_episodes", "12", "--accept-changed-inputs"], capsys)
    assert code == 0, err
    assert _latest_state(run)["inputs"]["data.prompts"] not in (recorded, None)  # the new data is what it records


def test_a_moved_model_folder_is_accepted_by_content_and_a_changed_one_refused(env, capsys, tiny_model_dir):  # noqa: F811
    tmp_path, base = env
    first = tmp_path / "models" / "policy-v1"
    shutil.copytree(tiny_model_dir, first)
    cfg = _config(tmp_path, base, model={"policy": str(first)})
    run = base["output_dir"]
    code, err = run_cli(["train", cfg], capsys)
    assert code == 0, err
    moved = tmp_path / "elsewhere" / "policy"
    os.makedirs(moved.parent)
    os.rename(first, moved)  # mv MODEL NEW: the old path is gone
    capsys.readouterr()
    code = main(["train", "--resume", run, "--total_episodes", "12", "--model.policy", str(moved)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"model.policy: the folder holds the same files as {first}" in " ".join(out.split()), out
    weights = moved / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of one weight
    weights.write_bytes(bytes(data))
    code, err = run_cli(["train", "--resume", run, "--total_episodes", "16", "--model.policy", str(moved)], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "model.policy" in err, err
    assert "--accept-changed-inputs" in err
