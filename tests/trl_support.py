"""Shared pieces of the TRL drop-in tests (tests/trl/): TRL's logged names, a PPOConfig maker, tiny models and
datasets in TRL's form, the bench venv's interpreter."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from conftest import TESTS
from lmppo.trl import PPOConfig

HERE = Path(TESTS)
EXAMPLE = HERE.parent / "examples" / "trl_ppo_script.py"

TRL_LOG_HISTORY_KEYS = {
    "eps",
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/scores",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "loss/policy_avg",
    "loss/value_avg",
    "val/clipfrac_avg",
    "policy/entropy_avg",
    "val/ratio",
    "val/ratio_var",
    "val/num_eos_tokens",
    "lr",
    "episode",
    "epoch",
    "step",
}


def trl_python() -> str | None:
    """The bench venv's interpreter (TRL 1.12), when there is one."""
    candidates = [os.environ.get("LMPPO_TRL_PYTHON", ""), str(HERE.parent / ".venv-trl" / "bin" / "python")]
    return next((c for c in candidates if c and os.path.isfile(c)), None)


def args(**kw) -> PPOConfig:
    return PPOConfig(**{"output_dir": "unused", "use_cpu": True, "bf16": False, "report_to": "none", **kw})


def seq_cls(tokenizer, seed):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForSequenceClassification(cfg)


def input_ids_dataset(tokenizer, texts):
    import datasets

    return datasets.Dataset.from_dict({"prompt": texts}).map(
        lambda row: {"input_ids": tokenizer(row["prompt"])["input_ids"]}, remove_columns=["prompt"]
    )


def trainer_args(tmp_path, **kw):
    return args(
        **{
            "output_dir": str(tmp_path / "out"),
            "per_device_train_batch_size": 4,
            "total_episodes": 8,
            "response_length": 5,
            "num_ppo_epochs": 2,
            "learning_rate": 1e-3,
            "stop_token": "eos",
            "local_rollout_forward_batch_size": 4,
            "per_device_eval_batch_size": 2,
            "num_sample_generations": 0,
            "save_strategy": "no",
            "disable_tqdm": True,
            **kw,
        }
    )


def src_env() -> dict:
    """The environment of a subprocess that imports this source tree's lmppo."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
