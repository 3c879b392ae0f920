"""`lmppo reward-model`: the command trains from a YAML file and dotted overrides spelled as `lmppo train`'s, says
where the model is, refuses bad options (and the old spellings) in one line, resumes."""

from __future__ import annotations

import json
import os

import pytest

from conftest import tiny_llama
from lmppo.apps.arguments import RENAMED
from lmppo.apps.cli import main


def test_the_command_end_to_end(tmp_path, tokenizer, capsys):
    base = tmp_path / "base"
    tiny_llama(tokenizer).save_pretrained(base)
    tokenizer.save_pretrained(base)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"chosen": f"good {i}", "rejected": f"bad {i}"}) + "\n" for i in range(20)))
    out = tmp_path / "rm"
    config = tmp_path / "rm.yaml"
    config.write_text(f"model:\n  policy: {base}\n  lora: {{enabled: false}}\ntraining:\n  epochs: 3\n")
    argv = ["reward-model", str(config), "--data.pairs", str(data), "--output_dir", str(out), "--data.holdout", "4"]
    assert main([*argv, "--training.epochs", "1", "--training.batch_size", "4", "--precision", "fp32"]) == 0
    said = capsys.readouterr().out
    assert f"wrote {out}/final/reward-model: held-out pair accuracy" in said and "4 steps in" in said
    assert "builtin:learned_reward" not in said  # the recipe reads runs/reward-model/final/reward-model, not this
    assert "precision fp32 as configured" in said  # --precision reached the trainer
    import yaml

    recorded = yaml.safe_load((out / "config.yaml").read_text())
    assert recorded["model"]["lora"]["enabled"] is False and recorded["precision"] == "fp32"  # the file, the flag
    assert recorded["training"]["epochs"] == 1 and recorded["data"]["holdout"] == 4  # overrides win over the file
    model = out / "final" / "reward-model"
    assert (model / "model.safetensors").is_file() and (model / "README.md").is_file()
    assert main([*argv]) == 2  # the folder holds a run: one error line
    assert "already holds a run" in capsys.readouterr().err
    assert main(["reward-model", "--resume", str(out)]) == 0  # already at its last step: exports again
    assert main(["reward-model", "--training.epochs", "0"]) == 2
    assert (
        capsys.readouterr().err.strip().splitlines()[-1] == "error: config field `training.epochs` = '0': must be > 0"
    )
    assert main(["reward-model", "--resume", str(out), "--seed", "3"]) == 2
    assert "takes no other option (--seed)" in capsys.readouterr().err


@pytest.mark.parametrize("old", [*RENAMED, "--overwrite"])
def test_an_old_spelling_is_one_line_naming_the_new_one(old, capsys):
    assert main(["reward-model", old, *([] if old in ("--full", "--overwrite") else ["2"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    now = RENAMED.get(old, "--overwrite true")
    assert err == [
        f"error: option `{old}` is now `{now}` (as `lmppo train` spells it); see `lmppo reward-model --help`"
    ]


def test_the_help_lists_every_option_with_its_documentation(capsys):
    assert main(["reward-model", "--help"]) == 0
    text = capsys.readouterr().out
    for option in (
        "--output_dir",
        "--seed",
        "--precision",
        "--device",
        "--model.policy",
        "--model.lora.r",
        "--data.pairs",
        "--data.holdout",
        "--training.center_rewards_coefficient",
        "--log.trackers",
        "--checkpoint.every",
    ):
        assert f"  {option} " in text, option
    assert "Pairs kept out of training" in text  # a field's docstring is its help


def test_the_default_folder_is_the_one_the_learned_reward_recipe_reads(tmp_path, monkeypatch):
    """With the default output_dir the command ends by naming the recipe that runs PPO on its model; the recipe's
    reward model path is read from the recipe, so the two cannot drift apart."""
    from lmppo.apps.reward_model import RECIPE_ON_IT, recipe_reads
    from lmppo.config import RewardModelConfig

    monkeypatch.chdir(tmp_path)
    default_model = os.path.join(RewardModelConfig().output_dir, "final", "reward-model")
    assert recipe_reads(RECIPE_ON_IT, default_model)
    assert recipe_reads(RECIPE_ON_IT, str(tmp_path / default_model))
    assert not recipe_reads(RECIPE_ON_IT, "runs/rm/final/reward-model")
