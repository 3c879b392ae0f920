"""Memory options: bf16 weights (`model.dtype`), the attention kernel (`model.attn_implementation`) and 4-bit QLoRA
(`model.load_in_4bit`), refused with one line where it cannot run (here: a CPU without bitsandbytes' kernels)."""

from __future__ import annotations

import math

import pytest
import torch

from lmppo.config import Config
from lmppo.errors import ConfigError
from lmppo.models.loading import hf_model
from lmppo.training.trainer import PPOTrainer

PROMPTS = [f"prompt number {i}" for i in range(8)]


def brevity(prompts, completions):
    return [-len(c) / 10 for c in completions]


def config(tmp_path, tiny_model_dir, **model):
    cfg = Config()
    cfg.precision, cfg.output_dir, cfg.log.trackers = "fp32", str(tmp_path / "run"), []
    cfg.model.policy = tiny_model_dir
    cfg.rollout.batch_size, cfg.rollout.max_new_tokens = 4, 4
    cfg.ppo.num_epochs, cfg.ppo.micro_batch_size, cfg.total_episodes = 1, 4, 4
    for k, v in model.items():
        setattr(cfg.model, k, v)
    return cfg


def test_bf16_weights_with_lora_train(tmp_path, tiny_model_dir):
    cfg = config(tmp_path, tiny_model_dir, dtype="bfloat16")
    cfg.model.lora.enabled = True
    trainer = PPOTrainer(cfg, prompts=PROMPTS, reward_functions=[brevity])
    base = [p for n, p in trainer.policy.named_parameters() if "lora_" not in n]
    adapters = [p for n, p in trainer.policy.named_parameters() if "lora_" in n]
    assert base and all(p.dtype == torch.bfloat16 for p in base)
    assert adapters and all(p.dtype == torch.float32 and p.requires_grad for p in adapters)
    before = [p.detach().clone() for p in adapters]
    [m] = trainer.train()
    assert all(math.isfinite(m[k]) for k in ("objective/kl", "loss/policy_avg", "loss/value_avg"))
    assert any(not torch.equal(a, b) for a, b in zip(before, adapters))


def test_attn_implementation_is_applied(tmp_path, tiny_model_dir):
    trainer = PPOTrainer(
        config(tmp_path, tiny_model_dir, attn_implementation="eager"), prompts=PROMPTS, reward_functions=[brevity]
    )
    assert hf_model(trainer.policy).config._attn_implementation == "eager"
    trainer.train()


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("dtype", "float16", "`float32`, `bfloat16`"),
        ("attn_implementation", "flash", "`flash_attention_2`"),
    ],
)
def test_bad_values_are_one_line_errors(tmp_path, tiny_model_dir, field, value, words):
    cfg = config(tmp_path, tiny_model_dir)
    with pytest.raises(ConfigError) as err:  # refused on assignment
        setattr(cfg.model, field, value)
    msg = str(err.value)
    assert f"model.{field}" in msg and repr(value) in msg
    assert words in msg and "\n" not in msg


def test_4bit_needs_lora(tmp_path, tiny_model_dir):
    cfg = config(tmp_path, tiny_model_dir, load_in_4bit=True)
    with pytest.raises(ConfigError, match="model.load_in_4bit.*model.lora.enabled"):
        cfg.validate()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where bitsandbytes cannot run")
def test_4bit_is_refused_on_cpu_before_any_model_loads(tmp_path, tiny_model_dir, monkeypatch):
    cfg = config(tmp_path, tiny_model_dir, load_in_4bit=True)
    cfg.model.lora.enabled = True
    loaded = []
    monkeypatch.setattr("lmppo.training.assembly.load_policy", lambda *a, **k: loaded.append(a))
    with pytest.raises(ConfigError) as err:
        PPOTrainer(cfg, prompts=PROMPTS, reward_functions=[brevity])
    assert not loaded
    msg = str(err.value)
    assert "model.load_in_4bit" in msg and "CUDA" in msg and "cpu" in msg and "\n" not in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal off CUDA")
def test_flash_attention_is_refused_on_cpu(tmp_path, tiny_model_dir):
    cfg = config(tmp_path, tiny_model_dir, attn_implementation="flash_attention_2")
    with pytest.raises(ConfigError, match="model.attn_implementation.*CUDA GPUs only"):
        PPOTrainer(cfg, prompts=PROMPTS, reward_functions=[brevity])
