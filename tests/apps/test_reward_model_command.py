"""`lmppo reward-model`: the command trains, says where the model is, refuses bad options in one line, resumes."""

from __future__ import annotations

import json
import os

from conftest import tiny_llama
from lmppo.apps.cli import main


def test_the_command_end_to_end(tmp_path, tokenizer, capsys):
    base = tmp_path / "base"
    tiny_llama(tokenizer).save_pretrained(base)
    tokenizer.save_pretrained(base)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"chosen": f"good {i}", "rejected": f"bad {i}"}) + "\n" for i in range(20)))
    out = tmp_path / "rm"
    argv = ["reward-model", "--data", str(data), "--base", str(base), "--output-dir", str(out), "--epochs", "1"]
    assert main([*argv, "--held-out", "4", "--batch-size", "4", "--full", "--precision", "fp32"]) == 0
    said = capsys.readouterr().out
    assert f"wrote {out}/model: held-out pair accuracy" in said and "4 steps in" in said
    assert "builtin:learned_reward" not in said  # the recipe reads runs/reward-model/model, not this folder
    assert "precision fp32 as configured" in said  # --precision reached the trainer
    recorded = json.loads((out / "reward_model.json").read_text())
    assert recorded["lora"] is False and recorded["precision"] == "fp32"  # --full, --precision
    assert (out / "model" / "model.safetensors").is_file() and (out / "model" / "README.md").is_file()
    assert main([*argv]) == 2  # the folder holds a run: one error line
    assert "holds a reward-model run" in capsys.readouterr().err
    assert main(["reward-model", "--resume", str(out)]) == 0  # already at its last step: exports again
    assert main(["reward-model", "--epochs", "0"]) == 2
    assert (
        capsys.readouterr().err.strip().splitlines()[-1]
        == "error: config field `epochs` = 0: must be a whole number >= 1"
    )


def test_the_default_folder_is_the_one_the_learned_reward_recipe_reads(tmp_path, monkeypatch):
    """With the default --output-dir the command ends by naming the recipe that runs PPO on its model; the recipe's
    reward model path is read from the recipe, so the two cannot drift apart."""
    from lmppo.apps.reward_model import RECIPE_ON_IT, recipe_reads
    from lmppo.training.reward_model import RewardModelSettings

    monkeypatch.chdir(tmp_path)
    default_model = os.path.join(RewardModelSettings().output_dir, "model")
    assert recipe_reads(RECIPE_ON_IT, default_model)
    assert recipe_reads(RECIPE_ON_IT, str(tmp_path / default_model))
    assert not recipe_reads(RECIPE_ON_IT, "runs/rm/model")
