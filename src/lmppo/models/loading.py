"""Loading the policy, tokenizer and value function, and the one forward pass they all share.

Departures from the usual HF usage, on purpose:
- Every model stays in eval mode: dropout is off, so the network that sampled a response is the network
  whose log-probabilities enter the PPO ratio (dropout would make the ratio noisy even at step 0).
- The forward pass runs the trunk once and applies the LM head only at response positions: logits over
  prompt positions (a (B, P, V) tensor, large with a 49k vocabulary) are never computed.
- Position ids come from the attention mask, so left-padded prompts see the same positions as unpadded ones.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from lmppo.config import BUILTIN_MODELS, Config, ModelConfig, hub_repo_id
from lmppo.errors import ConfigError, LmppoError
from lmppo.models.assets import resolve_model
from lmppo.models.attention import padding_known
from lmppo.models.files import (
    check_loaded_whole,
    check_model_folder,
    check_tokenizer_folder,
    is_adapter_folder,
    load_whole,
    loading,
)
from lmppo.models.hub import download_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def resolve_model_path(
    name_or_path: str, field: str = "model", allow_pickle: bool = False, weights: bool = True
) -> str:
    """A local folder that `from_pretrained` reads: built-in names are converted and cached once, Hub ids
    (`hub:ORG/NAME`, or `ORG/NAME` that is not a local folder) downloaded once (`lmppo.models.hub`); `field` names the
    config field in errors."""
    if name_or_path in BUILTIN_MODELS:
        return resolve_model(name_or_path)
    repo = hub_repo_id(name_or_path)
    if repo is None:
        return name_or_path
    return download_model(repo, field, name_or_path, allow_pickle=allow_pickle, weights=weights)


def model_fields(cfg: Config) -> list[tuple[str, str]]:
    """(field, value) of every model path a run of `cfg` loads: policy, tokenizer, critic start, reward models."""
    fields = [("model.policy", cfg.model.policy)]
    if cfg.model.tokenizer:
        fields.append(("model.tokenizer", cfg.model.tokenizer))
    if cfg.value.mode == "critic" and cfg.value.init_from not in ("auto", "reward_model", "policy"):
        fields.append(("value.init_from", cfg.value.init_from))
    fields += [(f"reward.sources[{i}].path", s.path) for i, s in enumerate(cfg.reward.sources) if s.kind == "model"]
    return fields


def fetch_hub_models(cfg: Config, policy_given: bool = False) -> None:
    """Download every Hub model the run names, before any model is loaded: a Hub that cannot be reached is one
    error naming the field, not a failure after the policy has loaded. `policy_given`: the policy and tokenizer
    are objects passed in, not loaded from `model.policy`."""
    for field, value in model_fields(cfg):
        if policy_given and field in ("model.policy", "model.tokenizer"):
            continue
        if hub_repo_id(value) is not None:
            resolve_model_path(value, field, cfg.model.allow_pickle, weights=field != "model.tokenizer")


NEW_SCORE_HEAD = ("score.",)
"""The key prefix of the `score` head a critic adds to a causal LM: missing from the folder by design."""


def _load_kwargs(mc: ModelConfig) -> dict:
    return {"trust_remote_code": mc.trust_remote_code, "use_safetensors": None if mc.allow_pickle else True}


def _check_loadable(path: str, field: str, mc: ModelConfig) -> None:
    """Refuse pickle-only weight folders unless allowed (they can run arbitrary code when loaded)."""
    if not os.path.isdir(path) or mc.allow_pickle:
        return
    files = os.listdir(path)
    if not any(f.endswith(".safetensors") for f in files) and any(f.endswith((".bin", ".pt", ".pth")) for f in files):
        raise ConfigError(
            field,
            path,
            "holds only pickle weights (.bin/.pt), which can run code when loaded; "
            "convert to safetensors or set model.allow_pickle: true",
        )


def load_tokenizer(path: str, mc: ModelConfig):
    from transformers import AutoTokenizer

    if is_adapter_folder(path) and not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        path = adapter_base(path, mc)  # an adapter folder saved without its tokenizer: the base's
    check_tokenizer_folder(path, "tokenizer")  # a missing or corrupt file: one error naming it
    with loading("tokenizer", path):
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=mc.trust_remote_code)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise LmppoError(f"tokenizer at {path} has neither a pad nor an eos token; add one")
        tok.pad_token = tok.eos_token
    return tok


WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""`model.dtype` -> the torch dtype the policy's weights are loaded in."""


def check_memory_options(mc: ModelConfig, device_type: str) -> None:
    """ConfigError, before any model is loaded, for memory options this machine cannot run: 4-bit loading
    (bitsandbytes' CUDA kernels) off a CUDA device or without the package; flash attention off CUDA."""
    if mc.load_in_4bit:
        if device_type != "cuda":
            raise ConfigError(
                "model.load_in_4bit",
                True,
                f"4-bit QLoRA needs bitsandbytes on a CUDA GPU; this run's "
                f"device is {device_type} (model.dtype = bfloat16 with LoRA halves the weights' memory "
                "here)",
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError("model.load_in_4bit", True, "needs the package `bitsandbytes` (pip install bitsandbytes)")
    if mc.attn_implementation.startswith("flash_attention") and device_type != "cuda":
        raise ConfigError(
            "model.attn_implementation",
            mc.attn_implementation,
            f"runs on CUDA GPUs only; this run's device is {device_type} (use `auto`, `sdpa` or `eager`)",
        )


def _quantization(mc: ModelConfig) -> dict:
    """from_pretrained arguments for `model.load_in_4bit` (QLoRA: NF4, double quantisation, bf16 compute)."""
    if not mc.load_in_4bit:
        return {}
    from transformers import BitsAndBytesConfig

    return {
        "quantization_config": BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    }


def adapter_base(adapter_dir: str, mc: ModelConfig) -> str:
    """The local folder of the base model a PEFT adapter folder names (adapter_config.json's
    `base_model_name_or_path`: a local folder, a Hub id or a built-in name, resolved as model.policy is)."""
    import json

    where = os.path.join(adapter_dir, "adapter_config.json")
    try:
        with open(where, encoding="utf-8") as fh:
            base = json.load(fh).get("base_model_name_or_path")
    except (OSError, ValueError) as err:
        raise ConfigError("model.policy", adapter_dir, f"its adapter_config.json cannot be read ({err})") from None
    if not isinstance(base, str) or not base:
        raise ConfigError("model.policy", adapter_dir, "its adapter_config.json names no base_model_name_or_path")
    return resolve_model_path(base, "model.policy's base (adapter_config.json)", mc.allow_pickle)


def load_policy(mc: ModelConfig, path: str, dtype: torch.dtype = torch.float32):
    """The policy as an HF causal LM (wrapped in PEFT when LoRA is on), in eval mode. A PEFT adapter folder (an SFT
    adapter, say) loads onto the base its config names and keeps training (`is_trainable`)."""
    if is_adapter_folder(path):
        from peft import PeftModel

        check_model_folder(path, "policy adapter", mc.allow_pickle)
        base = _load_causal_lm(mc, adapter_base(path, mc), dtype)
        with loading("policy adapter", path):
            model = PeftModel.from_pretrained(base, path, is_trainable=True)
        return prepare_policy(model, mc)
    return prepare_policy(_load_causal_lm(mc, path, dtype), mc)


def _load_causal_lm(mc: ModelConfig, path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    _check_loadable(path, "model.policy", mc)
    check_model_folder(path, "policy model", mc.allow_pickle)  # a missing or corrupt file: one error naming it
    with loading("policy model", path):
        model = load_whole(
            AutoModelForCausalLM.from_pretrained,
            path,
            "policy model",
            mc.strict,
            dtype=dtype,
            **_load_kwargs(mc),
            **_quantization(mc),
        )
    return model


def prepare_policy(model: nn.Module, mc: ModelConfig) -> nn.Module:
    """Apply LoRA if configured and put the model in eval mode (dropout off)."""
    if mc.lora.enabled and not hasattr(model, "disable_adapter"):
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        if getattr(model, "is_loaded_in_4bit", False):  # QLoRA: norms in fp32, inputs that carry gradients
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        targets = mc.lora.target_modules
        lora = LoraConfig(
            r=mc.lora.r,
            lora_alpha=mc.lora.alpha,
            lora_dropout=mc.lora.dropout,
            target_modules="all-linear" if targets == ["all-linear"] else targets,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    model.eval()
    if hasattr(model, "generation_config") and model.generation_config is not None:
        model.generation_config.use_cache = True
    return model


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """HF gradient checkpointing on `model` (`model.gradient_checkpointing`), non-reentrant (LoRA needs no input
    that requires grad). lmppo keeps every model in eval mode (dropout off), and HF checkpoints a decoder layer only
    when the layer is in training mode: the checkpointed layers' own `training` flag is set, their submodules stay
    in eval mode (dropout still off)."""
    base = hf_model(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ConfigError(
            "model.gradient_checkpointing",
            True,
            f"{type(base).__name__} does not support gradient checkpointing in transformers",
        )
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers' current name
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    layers = checkpointed_layers(base)
    if not layers:
        raise ConfigError(
            "model.gradient_checkpointing", True, f"{type(base).__name__} has no layers that transformers checkpoints"
        )
    for layer in layers:
        layer.training = True  # this module only (not .train(): its dropout stays off)


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of `model` that HF gradient checkpointing recomputes, with checkpointing switched on."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [
        m for m in hf_model(model).modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
    ]


def is_checkpointing(model: nn.Module) -> bool:
    """Gradient checkpointing is on and active in `model`: its checkpointed layers see training mode."""
    layers = checkpointed_layers(model)
    return bool(layers) and all(m.training for m in layers)


def hf_model(policy: nn.Module) -> PreTrainedModel:
    """The transformers model under a PEFT wrapper (LoRA layers are injected in place, so they are inside)."""
    return policy.get_base_model() if hasattr(policy, "get_base_model") else policy


def trunk_and_head(model: nn.Module) -> tuple[nn.Module, Optional[nn.Module]]:
    """(decoder trunk returning last_hidden_state, output head or None) of an HF model."""
    base = hf_model(model)
    trunk = getattr(base, base.base_model_prefix)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    return trunk, head


def check_vocab_fits(tokenizer, model: nn.Module, field: str, what: str = "policy") -> None:
    """LmppoError before the first sample when the tokenizer has ids the model's input embedding has no row for
    (tokens added to the tokenizer, `<tool>` as id 400 on a 400-row model): the message names both sizes and the
    added tokens, where torch would stop at the first such token with `IndexError: index out of range in self`.
    lmppo does not resize the embedding itself: new rows would be untrained noise in a run that learns from them."""
    embedding = hf_model(model).get_input_embeddings()
    rows = getattr(embedding, "num_embeddings", None)
    n = len(tokenizer)
    if rows is None or n <= rows:
        return
    added = sorted((i, t) for t, i in tokenizer.get_added_vocab().items() if i >= rows)
    shown = ", ".join(f"`{t}` ({i})" for i, t in added[:8]) + (f" and {len(added) - 8} more" if len(added) > 8 else "")
    beyond = f"added tokens without a row: {shown}" if added else f"ids {rows}-{n - 1} have no row"
    raise LmppoError(
        f"the tokenizer ({field}) has {n} tokens but the {what}'s input embedding has {rows} rows ({beyond}); use "
        f"the tokenizer the model was trained with, or resize the model to the tokenizer and save it "
        f"(`model.resize_token_embeddings({n})`, then train or accept untrained rows)"
    )


def hidden_size(model: nn.Module) -> int:
    cfg = hf_model(model).config
    return getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd")


class ValueHead(nn.Module):
    """Linear map from the trunk's hidden state to a scalar value, zero-initialised.

    Zero init: the first iteration's values are 0, so its advantages are plain Monte-Carlo returns rather
    than returns minus noise from a random head.
    """

    def __init__(self, hidden: int):
        super().__init__()
        self.score = nn.Linear(hidden, 1)
        nn.init.zeros_(self.score.weight)
        nn.init.zeros_(self.score.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.score(hidden.to(self.score.weight.dtype)).squeeze(-1)


class Critic(nn.Module):
    """A separate value network: a decoder trunk and a linear `score` head (the layout of HF
    `*ForSequenceClassification` models, so a reward model can be its starting point)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.trunk = getattr(model, model.base_model_prefix)
        self.head = getattr(model, "score", None)
        if self.head is None:
            raise LmppoError(
                f"the critic model ({type(model).__name__}) has no `score` head; a critic needs a "
                "decoder *ForSequenceClassification model (Llama, GPT-2, Qwen, ...)"
            )

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, padded: Optional[bool] = None
    ) -> torch.Tensor:
        """(B, P + T) -> (B, T + 1) values V(s_0) .. V(s_T) of the response states (`padded`: `run_trunk`)."""
        hidden = run_trunk(self.trunk, input_ids, attention_mask, padded)[:, prompt_len - 1 :]
        return self.head(hidden).squeeze(-1).float()


def build_critic(policy: nn.Module, init_path: Optional[str], mc: ModelConfig, dtype=torch.float32) -> Critic:
    """A critic from a reward-model folder (`init_path`) or, when None, a copy of the policy's trunk."""
    from transformers import AutoModelForSequenceClassification

    if init_path is not None:
        _check_loadable(init_path, "value.init_from", mc)
        check_model_folder(init_path, "critic's initial model (value.init_from)", mc.allow_pickle)
        with loading("critic's initial model (value.init_from)", init_path):
            model, info = AutoModelForSequenceClassification.from_pretrained(
                init_path, num_labels=1, dtype=dtype, output_loading_info=True, **_load_kwargs(mc)
            )
        what = "critic's initial model (value.init_from)"
        # a causal LM's folder: its `score` head is new (zeroed, as for a copy of the policy), its lm_head goes
        if check_loaded_whole(info, what, init_path, mc.strict, NEW_SCORE_HEAD):
            nn.init.zeros_(model.score.weight)
            if getattr(model.score, "bias", None) is not None:
                nn.init.zeros_(model.score.bias)
    else:
        base = hf_model(policy)
        config = copy.deepcopy(base.config)
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config)
        # with LoRA injected, the trunk's weights sit under `<layer>.base_layer.`; the critic gets the base weights
        trunk_state = {
            k.replace(".base_layer.", "."): v
            for k, v in getattr(base, base.base_model_prefix).state_dict().items()
            if ".lora_" not in k
        }
        getattr(model, model.base_model_prefix).load_state_dict(trunk_state, strict=True)
        nn.init.zeros_(model.score.weight)
        if getattr(model.score, "bias", None) is not None:
            nn.init.zeros_(model.score.bias)
        model.to(dtype)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = hf_model(policy).config.pad_token_id
    model.eval()
    return Critic(model)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only: left padding does not shift the prompt."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def run_trunk(
    trunk: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, padded: Optional[bool] = None
) -> torch.Tensor:
    """(B, L) -> (B, L, H) last hidden states. `padded`: whether `attention_mask` holds any padding, when the caller
    knows it without reading the device (the update loop); None: transformers reads the mask to find out."""
    with nullcontext() if padded is None else padding_known(padded):  # (None: nothing for a compiler to trace)
        out = trunk(
            input_ids=input_ids,
            attention_mask=attention_mask.long(),
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
    return out.last_hidden_state


@dataclass
class PolicyOutput:
    logits: torch.Tensor  # (B, T, V) response-position logits divided by the temperature
    values: Optional[torch.Tensor]  # (B, T + 1) V(s_0)..V(s_T) from the shared value head, or None


def policy_forward(
    policy: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    temperature: float,
    value_head: Optional[ValueHead] = None,
    padded: Optional[bool] = None,
) -> PolicyOutput:
    """One trunk pass over prompt + response; LM head only where response tokens are predicted. Logits in fp32, or
    bf16 under bf16 autocast at temperature 1 (`lmppo.core.logprobs` reads them in fp32 blocks: no fp32 copy).

    The hidden state at position P - 1 + t predicts response token t, so positions P-1 .. P+T-2 give the
    logits, and positions P-1 .. P+T-1 give the values of the T + 1 response states.
    """
    trunk, head = trunk_and_head(policy)
    hidden = run_trunk(trunk, input_ids, attention_mask, padded)  # (B, P + T, H)
    response_hidden = hidden[:, prompt_len - 1 :]  # (B, T + 1, H)
    logits = head(response_hidden[:, :-1])  # (B, T, V), bf16 under bf16 autocast
    if temperature != 1.0 or logits.dtype != torch.bfloat16:
        logits = logits.float() / temperature
    values = value_head(response_hidden).float() if value_head is not None else None
    return PolicyOutput(logits=logits, values=values)


def unwrap(module: nn.Module) -> nn.Module:
    return (
        module.module
        if hasattr(module, "module") and isinstance(module, nn.parallel.DistributedDataParallel)
        else module
    )


def model_dtype(cfg: Config) -> torch.dtype:
    """Master weights stay fp32; bf16 is applied by autocast around forward/backward passes."""
    return torch.float32


class Actor(nn.Module):
    """The policy (and, in `shared` mode, its value head) behind one `forward`, so that wrappers such as DDP
    see every parameter used in a training pass."""

    def __init__(self, policy: nn.Module, value_head: Optional[ValueHead] = None):
        super().__init__()
        self.policy = policy
        self.value_head = value_head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_len: int,
        temperature: float,
        padded: Optional[bool] = None,
    ) -> PolicyOutput:
        """`policy_forward` (`padded`: `run_trunk`)."""
        head = self.value_head
        return policy_forward(self.policy, input_ids, attention_mask, prompt_len, temperature, head, padded)


def is_peft_model(policy: nn.Module) -> bool:
    return hasattr(policy, "disable_adapter") and hasattr(policy, "peft_config")


def merged_state_dict(policy: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the plain HF model that a LoRA `policy` computes: each adapted weight W becomes
    W + scale * B @ A (peft's own `get_delta_weight`, in float32, cast back to W's dtype), the adapter tensors are
    dropped and the keys lose peft's `.base_layer`. The policy itself is not changed (no merge in place, no copy
    of the whole model)."""
    base = hf_model(policy)
    merged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in base.named_modules():
            if not (hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")):
                continue
            weight = module.base_layer.weight
            delta = sum(module.get_delta_weight(a).float() for a in module.active_adapters if a in module.lora_A)
            merged[f"{name}.weight"] = (weight.float() + delta).to(weight.dtype)
        out = {}
        for key, tensor in base.state_dict().items():
            if ".lora_" in key:
                continue
            key = key.replace(".base_layer.", ".")
            out[key] = merged.get(key, tensor)
    return out


def save_merged(policy: nn.Module, folder: str) -> None:
    """`folder`: the LoRA `policy` with its adapters merged (`merged_state_dict`), as a Hugging Face folder."""
    hf_model(policy).save_pretrained(folder, state_dict=merged_state_dict(policy), safe_serialization=True)
