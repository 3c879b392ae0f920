"""`final/` for inference (lmppo.run.export): the policy with its tokenizer, the value model, the cards."""

import os

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import tiny_llama
from lmppo.config import ModelConfig
from lmppo.run.export import export_model, writes_merged


def test_policy_value_head_and_cards_are_written(tmp_path, tokenizer):
    policy = tiny_llama(tokenizer)
    head = torch.nn.Linear(32, 1)
    final = str(tmp_path / "final")
    export_model(final, policy, tokenizer, value_head=head, cards=lambda folder: f"# card of {folder}\n")
    assert sorted(os.listdir(final)) == ["policy", "value"]
    reloaded = AutoModelForCausalLM.from_pretrained(os.path.join(final, "policy"))
    for name, tensor in policy.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    assert os.path.isfile(os.path.join(final, "policy", "tokenizer.json"))
    saved_head = load_file(os.path.join(final, "value", "value_head.safetensors"))
    assert torch.equal(saved_head["weight"], head.weight.detach())
    with open(os.path.join(final, "value", "README.md"), encoding="utf-8") as fh:
        assert fh.read() == "# card of value\n"
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]  # written atomically: no temporary left


def test_a_full_weight_policy_gets_no_merged_copy(tokenizer):
    model = ModelConfig()
    model.lora.save_merged = True
    assert not writes_merged(model, tiny_llama(tokenizer))  # merged copies are for LoRA policies only
