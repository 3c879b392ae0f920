"""lmppo.trl.config: TRL 1.12's PPOConfig (names, types, defaults, as TRL's own), parsed and documented with
HfArgumentParser; the migration guide names every field."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess

import pytest

from lmppo.trl import PPOConfig
from trl_fields import dump
from trl_support import HERE, trl_python

STORED = HERE / "data" / "trl_1_12_ppo_config_fields.json"
GUIDE = HERE.parent / "docs" / "migrating_from_trl.md"


def trl_fields() -> dict:
    """TRL 1.12's PPOConfig fields: read from TRL itself in the bench venv when present, else the stored list."""
    python = trl_python()
    stored = json.loads(STORED.read_text())
    if python is None:
        return stored
    out = subprocess.run(
        [python, str(HERE / "trl_fields.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    live = json.loads(out.stdout)
    assert live["trl"] == "1.12.0"
    if live["transformers"] == stored["transformers"]:
        assert live["fields"] == stored["fields"], "the stored list differs from TRL 1.12's own: regenerate it"
    return live


def test_ppo_config_fields_names_types_defaults_match_trl_1_12():
    import transformers

    trl = trl_fields()
    ours = dump(PPOConfig)
    if trl["transformers"] == transformers.__version__:
        # the whole list, in order: TrainingArguments' fields (same transformers) plus TRL's overrides and PPO fields
        assert ours == trl["fields"]
    else:  # another transformers version changes TrainingArguments itself: compare the fields TRL declares
        declared = set(PPOConfig.__annotations__)
        assert [r for r in ours if r["name"] in declared] == [r for r in trl["fields"] if r["name"] in declared]
    by_name = {r["name"]: r for r in ours}
    for name, default in (
        ("learning_rate", "3e-06"),
        ("response_length", "53"),
        ("temperature", "0.7"),
        ("kl_coef", "0.05"),
        ("num_ppo_epochs", "4"),
        ("local_rollout_forward_batch_size", "64"),
        ("logging_steps", "10"),
        ("gradient_checkpointing", "True"),
        ("bf16", "None"),
    ):
        assert by_name[name]["default"] == default


def test_hf_argument_parser_parses_trl_flags_and_prints_help():
    from transformers import HfArgumentParser

    parser = HfArgumentParser((PPOConfig,))
    (args,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            "out",
            "--use_cpu",
            "--per_device_train_batch_size",
            "4",
            "--num_ppo_epochs",
            "2",
            "--stop_token",
            "eos",
            "--kl_estimator",
            "k3",
            "--missing_eos_penalty",
            "1.0",
            "--bf16",
            "false",
            "--total_episodes",
            "100",
        ]
    )
    assert (
        args.per_device_train_batch_size,
        args.num_ppo_epochs,
        args.stop_token,
        args.kl_estimator,
        args.missing_eos_penalty,
        args.bf16,
        args.total_episodes,
    ) == (4, 2, "eos", "k3", 1.0, False, 100)
    text = parser.format_help()
    assert "--num_mini_batches" in text and "ppo.num_minibatches" in text  # lmppo's own help under the field
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--output_dir", "o", "--use_cpu", "--kl_estimator", "k2"])


def test_the_migration_guide_names_every_field():
    text = GUIDE.read_text(encoding="utf-8")
    missing = [f.name for f in dataclasses.fields(PPOConfig) if f"`{f.name}`" not in text]
    assert not missing
