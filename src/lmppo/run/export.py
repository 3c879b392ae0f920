"""The trained model for inference (`output_dir/final/`): policy, merged policy and value model in Hugging Face
format, each folder with its model card (`lmppo.run.model_card`)."""

from __future__ import annotations

import json
import os
import warnings
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from safetensors.torch import save_file
from torch import nn

from lmppo.config import Config, ModelConfig, hub_repo_id
from lmppo.models.loading import is_peft_model, save_merged
from lmppo.run import ownership
from lmppo.run.config_file import redacted_config_dict
from lmppo.run.layout import FINAL_FOLDERS, POLICY, POLICY_MERGED, VALUE
from lmppo.run.model_card import HeldoutRows, card_text
from lmppo.run.storage import atomic_dir

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def writes_merged(model: ModelConfig, policy: nn.Module) -> bool:
    """Whether final/ gets policy-merged: `model.lora.save_merged` on a LoRA policy, not on a 4-bit base."""
    return bool(model.lora.save_merged and is_peft_model(policy) and not model.load_in_4bit)


def warn_unmerged(model: ModelConfig, policy: nn.Module) -> None:
    """The warning that `model.lora.save_merged` gives no merged policy for a 4-bit base."""
    if model.lora.save_merged and model.load_in_4bit and is_peft_model(policy):
        warnings.warn(
            "model.lora.save_merged: no final/policy-merged for a 4-bit base (model.load_in_4bit); "
            "merge the adapter in final/policy onto the base loaded in bf16",
            stacklevel=3,
        )


def export_model(
    directory: str,
    policy: PreTrainedModel | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    value_model: Optional[PreTrainedModel] = None,
    value_head: Optional[nn.Module] = None,
    keep: str = "",
    merged: bool = False,
    cards: Optional[Callable[[str], str]] = None,
    adapter_base: Optional[str] = None,
) -> None:
    """`directory/policy` (the policy in Hugging Face format, safetensors, with its tokenizer; a LoRA policy: its
    adapter), `directory/policy-merged` when `merged` (a LoRA policy's adapters merged into full weights, with the
    tokenizer) and `directory/value` (the critic's model, or the shared value head's tensors), written atomically
    (`atomic_dir`); a failed write is one StorageError, with `keep` saying what is still intact. `cards`: folder
    name -> its README.md text (`lmppo.run.model_card`). `adapter_base`: the base model the adapter config names (a Hub
    id rather than the local cache folder it was loaded from)."""
    with atomic_dir(directory, "the trained model", keep, ownership.publishing) as tmp:
        policy.save_pretrained(os.path.join(tmp, POLICY), safe_serialization=True)
        tokenizer.save_pretrained(os.path.join(tmp, POLICY))
        adapter_config = os.path.join(tmp, POLICY, "adapter_config.json")
        if adapter_base and os.path.isfile(adapter_config):
            with open(adapter_config, encoding="utf-8") as fh:
                data = json.load(fh)
            data["base_model_name_or_path"] = adapter_base
            with open(adapter_config, "w", encoding="utf-8") as fh:
                json.dump(data, fh, indent=2)
        if merged:
            save_merged(policy, os.path.join(tmp, POLICY_MERGED))
            tokenizer.save_pretrained(os.path.join(tmp, POLICY_MERGED))
        if value_model is not None:
            value_model.save_pretrained(os.path.join(tmp, VALUE), safe_serialization=True)
        else:
            assert value_head is not None, "export_model needs value_model or value_head"
            os.makedirs(os.path.join(tmp, VALUE), exist_ok=True)
            save_file(
                {k: v.contiguous() for k, v in value_head.state_dict().items()},
                os.path.join(tmp, VALUE, "value_head.safetensors"),
            )
        for folder in FINAL_FOLDERS if cards is not None else ():
            if cards is not None and os.path.isdir(os.path.join(tmp, folder)):  # (replaces peft's card of an adapter)
                with open(os.path.join(tmp, folder, "README.md"), "w", encoding="utf-8") as fh:
                    fh.write(cards(folder))


def export_final(
    directory: str,
    config: Config,
    policy: PreTrainedModel | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    value_head: Optional[nn.Module],
    value_model: Optional[PreTrainedModel],
    base_model: str,
    cards: Callable[[str], str],
) -> None:
    """`export_model` of a finished run: `final/` of `config.output_dir`, the adapter's base named by its Hub id."""
    export_model(
        directory,
        policy,
        tokenizer,
        value_head=value_head,
        value_model=value_model,
        keep="the checkpoint of the last iteration is complete: free space and run "
        f"`lmppo train --resume {config.output_dir}` to write it again",
        merged=writes_merged(config.model, policy),
        cards=cards,
        adapter_base=hub_repo_id(base_model) if base_model else None,
    )


def final_card(
    folder: str,
    config: Config,
    base_model: str,
    policy: nn.Module,
    iterations: int,
    rewards: Sequence[tuple[str, float]],
    prompt_source: str,
    heldout: Optional[HeldoutRows] = None,
    heldout_title: str = "",
) -> str:
    """The README.md text of `final/<folder>` (`lmppo.run.model_card.card_text`); `heldout`: the before/after rows."""
    return card_text(
        folder,
        config,
        redacted_config_dict(config),
        base_model,
        adapter=is_peft_model(policy),
        merged=writes_merged(config.model, policy) if folder != VALUE else False,
        iterations=iterations,
        heldout=heldout,
        heldout_title=heldout_title,
        rewards=list(rewards),
        prompts=prompt_source if prompt_source.startswith("passed") else "",
    )
