"""The final models: a LoRA run's merged folder (`model.lora.save_merged`) and every final folder's model card."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import lmppo
from conftest import PROMPTS, frac_target_reward, tiny_llama
from lmppo.config import Config
from lmppo.models.loading import merged_state_dict
from lmppo.sampling.hf import left_pad
from lmppo.training.report import summarize_run
from lmppo.training.trainer import PPOTrainer


def _trainer(tokenizer, tmp_path, policy=None, **overrides) -> PPOTrainer:
    cfg = Config()
    cfg.precision = "fp32"
    cfg.output_dir, cfg.overwrite, cfg.log.trackers, cfg.log.sample_every = str(tmp_path / "run"), True, [], 0
    cfg.total_episodes, cfg.rollout.batch_size, cfg.rollout.max_new_tokens = 16, 8, 6
    cfg.rollout.temperature, cfg.rollout.stop_token = 1.0, "none"
    cfg.ppo.learning_rate, cfg.ppo.num_epochs, cfg.ppo.micro_batch_size = 3e-2, 2, 4
    cfg.model.lora.enabled, cfg.model.lora.r = True, 4
    for dotted, value in overrides.items():
        obj = cfg
        *parents, leaf = dotted.split("__")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, leaf, value)
    return PPOTrainer(
        cfg,
        policy=policy if policy is not None else tiny_llama(tokenizer),
        tokenizer=tokenizer,
        prompts=list(PROMPTS),
        reward_functions=[frac_target_reward(tokenizer)],
    )


def _inputs(tokenizer):
    ids, mask = left_pad([tokenizer.encode(p) for p in PROMPTS], tokenizer.pad_token_id)
    return ids, mask


@pytest.fixture(scope="module")
def lora_run(tokenizer, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_final")
    trainer = _trainer(tokenizer, tmp, data__holdout=2)
    trainer.train()
    return trainer, tmp / "run" / "final"


def test_merged_folder_computes_the_adapter_model(lora_run, tokenizer):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    trainer, final = lora_run
    merged_dir = final / "policy-merged"
    files = set(os.listdir(merged_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= files
    assert not any(f.startswith("adapter_") for f in files)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    assert type(merged) is LlamaForCausalLM
    assert set(merged.state_dict()) == set(tiny_llama(tokenizer).state_dict())  # every weight, no adapter keys
    ids, mask = _inputs(tokenizer)
    with torch.no_grad():
        adapter_logits = trainer.policy(input_ids=ids, attention_mask=mask).logits
        merged_logits = merged(input_ids=ids, attention_mask=mask).logits
        with trainer.policy.disable_adapter():
            base_logits = trainer.policy(input_ids=ids, attention_mask=mask).logits
    assert (adapter_logits - base_logits).abs().max() > 1e-3  # the adapter moved the model: the check has teeth
    real = mask.bool()  # (left-padding positions attend to nothing: their outputs depend on the attention kernel)
    torch.testing.assert_close(merged_logits[real], adapter_logits[real], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_merged_folder_loads_without_peft(lora_run):
    """A fresh interpreter in which `import peft` fails loads the merged folder with transformers alone."""
    _trainer_, final = lora_run
    code = (
        "import sys; sys.modules['peft'] = None\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(final / 'policy-merged')!r})\n"
        "print(type(m).__name__, sum(p.numel() for p in m.parameters()))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("LlamaForCausalLM ")


def test_merged_state_dict_leaves_the_policy_as_it_was(lora_run, tokenizer):
    trainer, _final = lora_run
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    merged_state_dict(trainer.policy)
    after = trainer.policy.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_no_merged_folder_when_switched_off(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path, model__lora__save_merged=False)
    trainer.train()
    final = tmp_path / "run" / "final"
    assert sorted(os.listdir(final)) == ["policy", "value"]
    assert "../policy-merged" not in (final / "policy" / "README.md").read_text()


def test_full_weights_run_has_no_merged_folder(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path, model__lora__enabled=False)
    trainer.train()
    final = tmp_path / "run" / "final"
    assert sorted(os.listdir(final)) == ["policy", "value"]
    card = (final / "policy" / "README.md").read_text()
    assert "library_name: transformers" in card and "all its weights" in card and "LoRA" not in card


def test_model_cards(lora_run):
    trainer, final = lora_run
    adapter_card = (final / "policy" / "README.md").read_text()
    merged_card = (final / "policy-merged" / "README.md").read_text()
    value_card = (final / "value" / "README.md").read_text()
    assert adapter_card.startswith("---\nlibrary_name: peft\n")
    assert "A LoRA adapter (peft)" in adapter_card and "../policy-merged" in adapter_card
    assert merged_card.startswith("---\nlibrary_name: transformers\n") and "without peft" in merged_card
    assert "value function" in value_card
    for card in (adapter_card, merged_card, value_card):
        assert f"Trained with lmppo {lmppo.__version__}." in card
        assert "## Base model" in card and "a model object built in memory" in card  # policy= was an object
        assert "| episodes | 16 (2 iterations of 8) |" in card and "| LoRA | r 4, alpha 32" in card
        assert "| reward | `frac_target` |" in card and "| prompts | passed to PPOTrainer(prompts=...) |" in card
        assert "learning_rate: 0.03" in card  # the run's config, in full
        assert "## Held-out prompts" not in card  # not yet: the summary adds it


def test_summary_adds_the_heldout_table_to_the_cards(lora_run):
    trainer, final = lora_run
    summary = summarize_run(trainer)
    after = summary["after"]
    for folder in ("policy", "policy-merged", "value"):
        card = (final / folder / "README.md").read_text()
        assert "## Held-out prompts, before and after training" in card
        assert "2 held-out prompts (`data.holdout`)" in card
        row = next(line for line in card.splitlines() if line.startswith("| score (training reward) |"))
        assert f"{after['score']:+.3f}" in row
        assert card.count("| reward/frac_target |") == 1


def test_card_of_a_hub_policy_names_it_in_the_metadata(tmp_path):
    from lmppo.run.model_card import card_text

    cfg = Config()
    cfg.model.policy, cfg.model.lora.enabled = "Qwen/Qwen2.5-0.5B", True
    card = card_text("policy", cfg, {"seed": 0}, "Qwen/Qwen2.5-0.5B", adapter=True, merged=True)
    assert "base_model: Qwen/Qwen2.5-0.5B" in card and "`Qwen/Qwen2.5-0.5B`" in card
    card = card_text("policy", cfg, {"seed": 0}, "hub:Qwen/Qwen2.5-0.5B", adapter=True, merged=True)
    assert "base_model: Qwen/Qwen2.5-0.5B" in card
    card = card_text("policy", cfg, {"seed": 0}, "smollm2", adapter=True, merged=True)
    assert "base_model:" not in card and "built-in SmolLM2-135M-Instruct" in card


def test_adapter_config_names_the_hub_id_not_the_cache_folder(tokenizer, tiny_model_dir, tmp_path):
    """A policy loaded from a Hub id: the adapter's base_model_name_or_path is the id (portable), not the folder
    of the local Hub cache it was read from. The folder stands in for the download (no Hub here)."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trainer = _trainer(tokenizer, tmp_path, policy=policy)
    trainer.base_model = "hub:someorg/somemodel"
    trainer.save_model(str(tmp_path / "out"))
    with open(tmp_path / "out" / "policy" / "adapter_config.json", encoding="utf-8") as fh:
        assert json.load(fh)["base_model_name_or_path"] == "someorg/somemodel"
    assert "base_model: someorg/somemodel" in (tmp_path / "out" / "policy" / "README.md").read_text()


def test_merging_onto_bf16_weights_keeps_their_dtype(tokenizer):
    """model.dtype bfloat16 + LoRA: W (bf16) + delta (from the fp32 adapters) is computed in fp32 and stored in bf16:
    the merged weights are the fp32 run's merged weights up to bf16 rounding."""
    from lmppo.models.loading import prepare_policy

    def lora_policy(dtype):
        mc = Config().model
        mc.lora.enabled, mc.lora.r = True, 4
        model = tiny_llama(tokenizer).to(dtype)
        torch.manual_seed(7)
        policy = prepare_policy(model, mc)
        torch.manual_seed(8)
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape) * 0.1)
        return policy

    merged32, merged16 = merged_state_dict(lora_policy(torch.float32)), merged_state_dict(lora_policy(torch.bfloat16))
    assert merged16.keys() == merged32.keys() and {t.dtype for t in merged16.values()} == {torch.bfloat16}
    base32 = tiny_llama(tokenizer).state_dict()
    adapted = [k for k in merged32 if not torch.equal(merged32[k], base32[k])]
    assert len(adapted) == 2 * 7  # every linear layer of both decoder layers (q, k, v, o, gate, up, down)
    for key in merged32:  # bf16 keeps 8 bits: W and W + delta each rounded to about 2^-9 of their size
        scale = float(base32[key].abs().max()) + float(merged32[key].abs().max())
        torch.testing.assert_close(merged16[key].float(), merged32[key], rtol=2**-8, atol=2**-8 * scale, msg=key)
