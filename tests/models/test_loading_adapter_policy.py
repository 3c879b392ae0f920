"""model.policy naming a PEFT adapter folder (an SFT adapter): its base comes from adapter_config.json, the adapter
keeps training, the reference is the adapter as loaded (`frozen`, the default) or the bare base (`base`), and the
merged export loads without peft."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import PROMPTS, frac_target_reward, small_config, tiny_llama
from lmppo.errors import ConfigError


@pytest.fixture()
def sft_adapter(tmp_path, tokenizer):
    """(adapter folder, base folder): a LoRA adapter whose B factors are not zero (it changes the base), saved
    without a tokenizer (the base's is used)."""
    from peft import LoraConfig, get_peft_model

    base_dir, adapter_dir = tmp_path / "base", tmp_path / "sft"
    tiny_llama(tokenizer).save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    model = get_peft_model(
        tiny_llama(tokenizer).from_pretrained(base_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(adapter_dir)
    return str(adapter_dir), str(base_dir)


def adapter_weights(policy) -> dict[str, torch.Tensor]:
    """The trained LoRA tensors under peft's saved names (without the adapter name)."""
    return {n.replace(".default", ""): p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}


def trainer(tmp_path, tokenizer, adapter_dir, **fields):
    from lmppo import PPOTrainer

    cfg = small_config(
        tmp_path / "run", data__prompts=str(tmp_path / "prompts.txt"), model__policy=adapter_dir, **fields
    )
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return PPOTrainer(cfg, reward_functions=[frac_target_reward(tokenizer)])


def logits(model, tokenizer) -> torch.Tensor:
    ids = torch.tensor([tokenizer.encode("the movie was good")])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_adapter_loads_as_saved_keeps_training_and_merges(tmp_path, tokenizer, sft_adapter):
    from transformers import AutoModelForCausalLM

    adapter_dir, _base_dir = sft_adapter
    t = trainer(tmp_path, tokenizer, adapter_dir)
    saved = load_file(f"{adapter_dir}/adapter_model.safetensors")
    start = adapter_weights(t.policy)
    assert set(start) == set(saved) and all(torch.equal(start[k], saved[k]) for k in saved)  # iteration 0
    assert not t.reference.adapter_off and t.reference.adapter  # default: the reference is the adapter as loaded
    t.train()
    after = adapter_weights(t.policy)
    assert any(not torch.equal(after[k], saved[k]) for k in saved)  # training changed the adapter
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final" / "policy-merged")
    assert not hasattr(merged, "peft_config")  # a plain transformers model, loaded without peft
    assert torch.allclose(logits(merged, tokenizer), logits(t.policy, tokenizer), atol=1e-4)


def test_the_reference_is_the_bare_base_on_request(tmp_path, tokenizer, sft_adapter):
    from transformers import AutoModelForCausalLM

    adapter_dir, base_dir = sft_adapter
    t = trainer(tmp_path, tokenizer, adapter_dir, reference__mode="base")
    assert t.reference.adapter_off and not t.reference.initial_is_base
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    with t.reference.as_reference(t.policy):
        assert torch.allclose(logits(t.policy, tokenizer), logits(base, tokenizer), atol=1e-5)
    assert not torch.allclose(logits(t.policy, tokenizer), logits(base, tokenizer), atol=1e-3)  # the SFT policy


def test_base_reference_needs_a_lora_policy(tmp_path, tokenizer, tiny_model_dir):
    with pytest.raises(ConfigError, match="`reference.mode` = 'base': is the base model under a LoRA policy"):
        trainer(tmp_path, tokenizer, tiny_model_dir, reference__mode="base")


def test_an_adapter_without_a_base_is_one_error(tmp_path, tokenizer, sft_adapter):
    import json

    adapter_dir, _ = sft_adapter
    path = f"{adapter_dir}/adapter_config.json"
    config = json.load(open(path))
    config["base_model_name_or_path"] = None
    json.dump(config, open(path, "w"))
    with pytest.raises(ConfigError, match="adapter_config.json names no base_model_name_or_path"):
        trainer(tmp_path, tokenizer, adapter_dir)
