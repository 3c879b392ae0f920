"""The model card (`README.md`) of each folder under `OUTPUT_DIR/final/`.

A card says what the folder holds and how to load it, the base model, the training settings that matter (the
run's whole config, secrets masked, below them), the held-out before/after table when the run measured one (the
end-of-run summary writes the cards again with it), and the lmppo version. Its YAML header is the Hub's model-card
metadata (`library_name`, `base_model` when the base is a Hub id, `tags`), so a pushed folder shows as expected.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

import yaml

from lmppo.config import BUILTIN_MODELS, Config, hub_repo_id
from lmppo.run.layout import FINAL_FOLDERS, POLICY, POLICY_MERGED, VALUE


def lmppo_version() -> str:
    """`lmppo.__version__`, read from the loaded package (importing the root here would loop through it)."""
    return str(getattr(sys.modules.get("lmppo"), "__version__", "unknown"))


LOCAL_PATH = "PATH"
"""What a card says to load from while it is on disk (the folder it is in); `hub_card` puts the repo id there."""

HeldoutRows = Sequence[tuple[str, str, str, str]]
"""(metric, before, after, change) rows, as `lmppo.evaluation.tables.metric_rows` gives them."""


def base_model_name(base_model: str) -> str:
    """The policy's starting model as the user named it (a Hub id without its `hub:` prefix)."""
    if not base_model:
        return "a model object built in memory and passed to PPOTrainer(policy=...)"
    if base_model in BUILTIN_MODELS:
        return f"{base_model} (lmppo's built-in SmolLM2-135M-Instruct)"
    return hub_repo_id(base_model) or base_model


def _rewards(cfg: Config, rewards: Optional[Sequence[tuple[str, float]]]) -> str:
    """The reward sources: `rewards` ((name, weight) of the run's sources), else the config's."""
    if rewards is None:
        rewards = [(s.name or s.path, float(s.weight)) for s in cfg.reward.sources]
    parts = [f"`{name}`" + ("" if float(w) == 1.0 else f" (weight {float(w):g})") for name, w in rewards]
    return ", ".join(parts) or "none named"


def _settings(
    cfg: Config, iterations: Optional[int], rewards: Optional[Sequence[tuple[str, float]]], prompts: str
) -> list[tuple[str, str]]:
    ppo, kl = cfg.ppo, cfg.kl
    rows = [
        (
            "episodes",
            f"{cfg.total_episodes} ({iterations if iterations is not None else cfg.num_iterations} "
            f"iterations of {cfg.rollout.batch_size})",
        ),
        ("prompts", prompts or f"`{cfg.data.prompts}`"),
        ("reward", _rewards(cfg, rewards)),
        (
            "KL penalty",
            f"coef {kl.coef:g}, controller `{kl.controller}`, estimator `{kl.estimator}`; "
            f"reference `{cfg.reference.mode}`",
        ),
        (
            "PPO",
            f"learning rate {ppo.learning_rate:g}, {ppo.num_epochs} epochs x {ppo.num_minibatches} "
            f"minibatches, value `{cfg.value.mode}`",
        ),
        ("sampling", f"temperature {cfg.rollout.temperature:g}, up to {cfg.rollout.max_new_tokens} new tokens"),
        ("precision", f"`{cfg.precision}`, weights `{cfg.model.dtype}`"),
    ]
    lora = cfg.model.lora
    if lora.enabled:
        rows.append(("LoRA", f"r {lora.r}, alpha {lora.alpha:g}, targets {', '.join(lora.target_modules)}"))
    return rows


def _what(folder: str, adapter: bool, merged: bool) -> tuple[str, str]:
    """(library_name, a paragraph on what the folder holds and how to load it)."""
    if folder == VALUE:
        text = (
            "The value function trained alongside the policy (a `*ForSequenceClassification` critic, or the "
            "shared value head's tensors in `value_head.safetensors`). It is not needed for generation."
        )
        return "transformers", text
    load = (
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f'model = AutoModelForCausalLM.from_pretrained("{LOCAL_PATH}")\n'
        f'tokenizer = AutoTokenizer.from_pretrained("{LOCAL_PATH}")'
        "\n```"
    )
    if folder == POLICY and adapter:
        text = (
            "A LoRA adapter (peft) on the base model below. Load it with peft (`PeftModel.from_pretrained`), or "
            "with transformers when peft is installed:\n\n" + load
        )
        if merged:
            text += "\n\nThe same model merged into full weights (no peft needed) is in `../policy-merged`."
        return "peft", text
    if folder == POLICY_MERGED:
        return "transformers", (
            "The LoRA adapter of `../policy` merged into the base model's weights: a plain "
            "Hugging Face model, loaded without peft:\n\n" + load
        )
    return "transformers", "The trained policy with all its weights:\n\n" + load


def card_text(
    folder: str,
    cfg: Config,
    config_dict: dict,
    base_model: str,
    adapter: bool = False,
    merged: bool = False,
    iterations: Optional[int] = None,
    heldout: Optional[HeldoutRows] = None,
    heldout_title: str = "",
    rewards: Optional[Sequence[tuple[str, float]]] = None,
    prompts: str = "",
) -> str:
    """The README.md of `final/<folder>`. `config_dict`: the run's config as written to config.yaml (masked);
    `base_model`: the policy's starting model (`model.policy`, or a passed object's name_or_path); `adapter`:
    `policy` holds a LoRA adapter; `merged`: `policy-merged` exists; `heldout`: the before/after rows;
    `rewards`: (name, weight) of the run's reward sources (default: the config's); `prompts`: where the prompts
    came from (default: `data.prompts`)."""
    library, what = _what(folder, adapter, merged)
    meta: dict[str, object] = {"library_name": library}
    repo = hub_repo_id(base_model) if base_model else None
    if repo:
        meta["base_model"] = repo
    meta["tags"] = ["lmppo", "ppo", "rlhf"] + (["lora"] if adapter else [])
    if folder != VALUE:
        meta["pipeline_tag"] = "text-generation"
    name = os.path.basename(os.path.normpath(cfg.output_dir)) or "run"
    lines = [
        "---",
        yaml.safe_dump(meta, sort_keys=False).strip(),
        "---",
        "",
        f"# {name}: {'value function' if folder == VALUE else 'policy'} trained with lmppo (PPO)",
        "",
        what,
        "",
        "## Base model",
        "",
        f"`{base_model_name(base_model)}`",
        "",
        "## Training",
        "",
        "| setting | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v.replace('|', '/')} |" for k, v in _settings(cfg, iterations, rewards, prompts)]
    lines.append("")
    if heldout:
        lines += [
            "## Held-out prompts, before and after training",
            "",
            heldout_title,
            "",
            "| metric | before | after | change |",
            "|---|---:|---:|---:|",
        ]
        lines += [f"| {' | '.join(cell.replace('|', '/') for cell in row)} |" for row in heldout]
        lines.append("")
    lines += [
        "<details><summary>the run's config (config.yaml, secrets masked)</summary>",
        "",
        "```yaml",
        yaml.safe_dump(config_dict, sort_keys=False).strip(),
        "```",
        "",
        "</details>",
        "",
        f"Trained with lmppo {lmppo_version()}.",
        "",
    ]
    return "\n".join(lines)


def hub_card(text: str, repo_id: str) -> str:
    """A card `text` as it is uploaded to `repo_id`: it loads from the repo id, and a local base folder (a path,
    meaningless on the Hub) is named by its last part only."""
    text = text.replace(f'from_pretrained("{LOCAL_PATH}")', f'from_pretrained("{repo_id}")')
    marker = "## Base model\n\n`"
    start = text.find(marker)
    if start >= 0:
        start += len(marker)
        end = text.index("`", start)
        base = text[start:end]
        on_hub = "\nbase_model: " in text.split("\n---", 1)[0]  # card_text names a Hub base in the metadata
        if not on_hub and (os.sep in base or base.startswith(".")):
            name = os.path.basename(os.path.normpath(base))
            text = text[:start] + f"{name}` (a local model folder, not on the Hub)" + text[end + 1 :]
    return text


def card_folders(final_dir: str) -> list[str]:
    """The folders of `final_dir` that get a card."""
    return [f for f in FINAL_FOLDERS if os.path.isdir(os.path.join(final_dir, f))]
