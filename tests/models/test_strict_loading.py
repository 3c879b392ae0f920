"""Every model load is checked whole: a real folder whose config.json and weights disagree (6 layers in the config,
4 in the weights; 2 in the config, 4 in the weights) is refused naming the tensors, whatever the console shows;
`model.strict: false` loads it with one warning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import yaml

from cli_support import REWARDS
from conftest import REPO, tiny_llama
from lmppo.config import ModelConfig
from lmppo.models.files import ModelFolderError
from lmppo.models.loading import build_critic, load_policy


def _folder_saying(tmp_path, tokenizer, config_layers: int, name: str = "model") -> str:
    """A real model folder: the weights of a 4-layer Llama, its config.json edited to say `config_layers`."""
    path = tmp_path / name
    tiny_llama(tokenizer, layers=4).save_pretrained(path)
    tokenizer.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = config_layers
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_a_config_with_more_layers_than_the_weights_is_refused_naming_the_missing_tensors(tmp_path, tokenizer):
    folder = _folder_saying(tmp_path, tokenizer, 6)
    with pytest.raises(ModelFolderError) as caught:
        load_policy(ModelConfig(policy=folder), folder)
    text = str(caught.value)
    assert "not in the weights (they would start random)" in text and "model.layers.4." in text
    assert "model.strict: false" in text and folder in text


def test_a_config_with_fewer_layers_than_the_weights_is_refused_naming_the_dropped_tensors(tmp_path, tokenizer):
    folder = _folder_saying(tmp_path, tokenizer, 2)
    with pytest.raises(ModelFolderError) as caught:
        load_policy(ModelConfig(policy=folder), folder)
    text = str(caught.value)
    assert "have no place in the model (they would be dropped)" in text and "model.layers.2." in text
    assert "tensor(s)" in text


def test_strict_false_loads_it_with_one_warning_naming_the_tensors(tmp_path, tokenizer):
    folder = _folder_saying(tmp_path, tokenizer, 2)
    with pytest.warns(UserWarning, match=r"model\.layers\.2\..*loaded anyway: model\.strict is false") as caught:
        model = load_policy(ModelConfig(policy=folder, strict=False), folder)
    assert len([w for w in caught if "model.strict" in str(w.message)]) == 1
    assert model.config.num_hidden_layers == 2


def test_a_whole_folder_loads_without_a_word(tmp_path, tokenizer):
    folder = _folder_saying(tmp_path, tokenizer, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert load_policy(ModelConfig(policy=folder), folder).config.num_hidden_layers == 4


def test_a_critic_from_a_causal_lm_folder_gets_its_new_score_head_but_not_a_cut_trunk(tmp_path, tokenizer, llama):
    whole = _folder_saying(tmp_path, tokenizer, 4, "whole")
    critic = build_critic(llama, whole, ModelConfig())  # the score head is new by design: no complaint
    assert float(critic.head.weight.detach().abs().sum()) == 0.0
    cut = _folder_saying(tmp_path, tokenizer, 6, "cut")
    with pytest.raises(ModelFolderError, match=r"critic's initial model .*model\.layers\.4\."):
        build_critic(llama, cut, ModelConfig())


def test_a_reward_model_whose_weights_disagree_with_its_config_is_refused(tmp_path, tokenizer):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from lmppo.config.schema import RewardSourceConfig
    from lmppo.errors import RewardError
    from lmppo.rewards.model import ModelSource
    from lmppo.rewards.sources import SourceContext

    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    path = tmp_path / "rm"
    LlamaForSequenceClassification(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(RewardError, match=r"would be dropped\): `model\.layers\.2\."):
        ModelSource(RewardSourceConfig(kind="model", path=str(path)), SourceContext())


def test_lmppo_train_on_such_a_folder_ends_with_one_error_line_and_trains_nothing(tmp_path, tokenizer):
    """The real command, quiet console: rc 2, one `error:` line naming the tensors, no run folder contents."""
    folder = _folder_saying(tmp_path, tokenizer, 6)
    (tmp_path / "prompts.txt").write_text("the movie was\nthis film is\nmy friend felt\nthe story seemed\n")
    (tmp_path / "rewards.py").write_text(REWARDS)
    config = {
        "output_dir": str(tmp_path / "run"),
        "total_episodes": 4,
        "model": {"policy": folder},
        "data": {"prompts": str(tmp_path / "prompts.txt")},
        "rollout": {"batch_size": 4, "max_new_tokens": 4, "stop_token": "none"},
        "reward": {"sources": [{"kind": "function", "path": f"{tmp_path / 'rewards.py'}:ok"}]},
        "ppo": {"num_epochs": 1, "micro_batch_size": 4},
        "log": {"trackers": [], "sample_every": 0},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "lmppo.apps.cli", "train", str(tmp_path / "cfg.yaml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: cannot load") or lines[0].startswith("error: the policy"), (
        lines
    )
    assert "model.layers.4." in lines[0] and "model.strict: false" in lines[0]
    assert not os.path.exists(tmp_path / "run" / "checkpoints") and not os.path.exists(tmp_path / "run" / "final")
