"""lmppo.trl.scripts: TrlParser reads a config file and the command line as TRL's does."""

from __future__ import annotations

import os

from lmppo.trl import PPOConfig


def test_trl_parser_reads_a_config_file_and_the_command_line(tmp_path):
    from lmppo.trl import ModelConfig, ScriptArguments, TrlParser

    config = tmp_path / "ppo.yaml"
    config.write_text(
        "env: {LMPPO_TEST_VAR: seven}\nnum_ppo_epochs: 2\nlora_r: 8\ndataset_name: prompts_ds\n"
        "output_dir: from_file\nuse_cpu: true\nbf16: false\n"
    )
    parser = TrlParser((ScriptArguments, PPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(
        ["--config", str(config), "--num_ppo_epochs", "3"]
    )
    assert (script_args.dataset_name, training_args.num_ppo_epochs, training_args.output_dir, model_args.lora_r) == (
        "prompts_ds",
        3,
        "from_file",
        8,
    )
    assert os.environ.pop("LMPPO_TEST_VAR") == "seven"
