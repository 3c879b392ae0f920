"""`lmppo warp`: members trained seeds apart on one held-out split, merged at the KL budget; kept, resumed after a
real kill, merged again at a new budget without retraining; and its refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import PROMPTS, ctrl_c_as_in_a_terminal, small_config
from lmppo.apps.cli import main
from lmppo.config import RewardSourceConfig, load_config, save_config

REWARD = """import os, time

def length_reward(prompts, completions):
    freeze = os.environ.get("FREEZE_WHEN")
    if freeze and os.path.isdir(freeze):  # the member's first checkpoint is published: hang, to be killed
        open(os.environ["FROZEN_MARK"], "w").close()
        time.sleep(600)
    return [len(c) / 10.0 for c in completions]
"""


def _config(tmp_path, tiny_model_dir, name="warp", **fields) -> str:
    reward = tmp_path / "warp_reward.py"
    reward.write_text(REWARD)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS * 2) + "\n")
    cfg = small_config(
        tmp_path / name,
        iterations=3,
        model__policy=tiny_model_dir,
        model__lora__enabled=True,
        model__lora__r=4,
        checkpoint__every=1,
        data__prompts=str(prompts),
        data__holdout=6,
        seed=3,
        **fields,
    )
    cfg.reward.sources = [RewardSourceConfig(kind="function", path=f"{reward}:length_reward", name="length")]
    path = tmp_path / f"{name}.yaml"
    save_config(cfg, str(path))
    return str(path)


def _run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, " ".join(out.split()), err  # rich wraps long lines


def _adapter(folder) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "final", "policy", "adapter_model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_members_train_seeds_apart_on_one_split_and_merge_at_the_budget(tmp_path, tiny_model_dir, capsys):
    config = _config(tmp_path, tiny_model_dir)
    out = tmp_path / "warp"
    code, said, err = _run(["warp", config, "--kl-budget", "1000"], capsys)
    assert code == 0, err
    members = [out / "member-0", out / "member-1"]
    seeds = [load_config(str(m / "config.yaml")) for m in members]
    assert [c.seed for c in seeds] == [3, 4]
    assert [c.data.holdout_seed for c in seeds] == [3, 3]  # one held-out split, where the merge's KL is measured
    assert not _same(_adapter(members[0]), _adapter(members[1]))
    # member 0 is the run `lmppo train` makes of the same config
    assert main(["train", config, "--output_dir", str(tmp_path / "plain")]) == 0
    assert _same(_adapter(members[0]), _adapter(tmp_path / "plain"))
    whole = json.loads((out / "merged-kl1000" / "merge.json").read_text())
    assert whole["inputs"] == [str(m / "final" / "policy") for m in members]
    assert whole["toward_start"] == 1.0 and "the whole merge is under the budget" in said
    kl_whole = whole["kl_budget"]["chosen"]["kl_exact"]
    assert kl_whole > 0

    # a second budget: the same members, untouched, merged again into a folder of its own
    stamps = [os.stat(m / "final" / "policy" / "adapter_model.safetensors").st_mtime_ns for m in members]
    budget = round(kl_whole / 2, 6)
    code, said, err = _run(["warp", config, "--kl-budget", str(budget)], capsys)
    assert code == 0, err
    assert said.count("finished, kept") == 2
    assert stamps == [os.stat(m / "final" / "policy" / "adapter_model.safetensors").st_mtime_ns for m in members]
    half = json.loads((out / f"merged-kl{budget:g}" / "merge.json").read_text())["kl_budget"]
    assert half["chosen"]["toward_start"] < 1.0
    assert abs(half["chosen"]["kl_exact"] - budget) <= 0.1 * budget
    assert json.loads((out / "warp.json").read_text())["members"] == 2


def test_a_killed_warp_resumes_its_member_and_ends_as_an_uninterrupted_one(tmp_path, tiny_model_dir, capsys):
    config = _config(tmp_path, tiny_model_dir, name="killed")
    out = tmp_path / "killed"
    mark = tmp_path / "frozen"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        FREEZE_WHEN=str(out / "member-1" / "checkpoints" / "iter-00000001"),
        FROZEN_MARK=str(mark),
    )  # one thread, as in this process: the same sums
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmppo.apps.cli", "warp", config, "--kl-budget", "1000"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while not mark.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert mark.exists(), proc.stderr.read().decode() if proc.poll() is not None else "never reached member 1"
    os.killpg(proc.pid, signal.SIGKILL)  # in member 1's second iteration, after its first checkpoint
    proc.wait()
    assert (out / "member-0" / "final" / "policy").is_dir() and not (out / "member-1" / "final").exists()

    code, said, err = _run(["warp", config, "--kl-budget", "1000"], capsys)
    assert code == 0, err
    assert "member-0: finished, kept" in said and "member-1: resuming from" in said

    fresh = _config(tmp_path, tiny_model_dir, name="fresh")
    assert main(["warp", fresh, "--kl-budget", "1000"]) == 0
    for member in ("member-0", "member-1"):
        assert _same(_adapter(out / member), _adapter(tmp_path / "fresh" / member)), member
    kl = [
        json.loads((d / "merged-kl1000" / "merge.json").read_text())["kl_budget"]["chosen"]["kl_exact"]
        for d in (out, tmp_path / "fresh")
    ]
    assert kl[0] == kl[1]


@pytest.mark.parametrize(
    "extra, field",
    [
        (["--members", "1"], "--members 1"),
        (["--kl-budget", "0"], "--kl-budget 0"),
        (["--push_to_hub", "me/model"], "push_to_hub"),
        (["--ppo.learning_rate", "-1"], "ppo.learning_rate"),
        # the merge's options are checked before the members train, naming the command the user ran
        (["--tolerance", "2"], "lmppo warp: --tolerance 2"),
        (["--max-evals", "0"], "lmppo warp: --max-evals 0"),
    ],
)
def test_refusals_are_one_error_line_before_any_training(tmp_path, tiny_model_dir, capsys, extra, field):
    config = _config(tmp_path, tiny_model_dir)
    argv = ["warp", config, "--kl-budget", "2"] + extra
    if "--kl-budget" in extra:
        argv = ["warp", config] + extra
    code, _, err = _run(argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and field in lines[0], err
    assert not (tmp_path / "warp" / "member-0").exists()


def test_a_folder_of_another_warp_or_other_files_is_refused(tmp_path, tiny_model_dir, capsys):
    config = _config(tmp_path, tiny_model_dir, total_episodes=8)  # one iteration per member
    assert main(["warp", config, "--kl-budget", "1000"]) == 0
    capsys.readouterr()
    stamp = os.stat(tmp_path / "warp" / "member-0" / "final" / "policy" / "adapter_model.safetensors").st_mtime_ns
    code, _, err = _run(["warp", config, "--kl-budget", "1000", "--ppo.learning_rate", "0.002"], capsys)
    assert code == 2 and err.startswith("error:") and "ppo.learning_rate differs" in err, err
    code, _, err = _run(["warp", config, "--kl-budget", "1000", "--members", "3"], capsys)
    assert code == 2 and "members differs" in err, err
    assert (
        stamp == os.stat(tmp_path / "warp" / "member-0" / "final" / "policy" / "adapter_model.safetensors").st_mtime_ns
    )
    assert not (tmp_path / "warp" / "member-2").exists()

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    code, _, err = _run(["warp", config, "--kl-budget", "2", "--output_dir", str(other)], capsys)
    assert code == 2 and "already holds files" in err, err
    assert os.listdir(other) == ["notes.txt"]


def test_ctrl_c_says_how_to_continue(tmp_path, tiny_model_dir):
    config = _config(tmp_path, tiny_model_dir, name="stopped")
    mark = tmp_path / "frozen"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        FREEZE_WHEN=str(tmp_path / "stopped" / "member-0" / "checkpoints" / "iter-00000001"),
        FROZEN_MARK=str(mark),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmppo.apps.cli", "warp", config, "--kl-budget", "2"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=ctrl_c_as_in_a_terminal,
    )
    deadline = time.time() + 300
    while not mark.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert mark.exists(), "never reached member 0's second iteration"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert err.decode().strip().splitlines()[-1].startswith("interrupted; run the same `lmppo warp` command again")
