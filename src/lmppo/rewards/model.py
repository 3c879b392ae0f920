"""Reward from a sequence-classification model (one label) with its own tokenizer.

The reward model reads text, not the policy's token ids: it sees ``prompt + completion`` (the prompt as the policy
saw it, chat template included) through its own tokenizer, so it may use a different tokenizer than the policy.
Sequences are right-padded (left-truncated to the model's length limit, so the end of the completion is always
seen) and scored in batches under ``torch.inference_mode``.

The score is read at the last real token. For decoder models with a ``score`` head (Llama, Qwen, GPT-2, ...)
lmppo runs ``model.base_model`` and ``model.score`` itself and gathers at ``attention_mask.sum(-1) - 1``, which
does not depend on the model's ``pad_token_id`` (transformers' own pooling looks for the first pad token and gets
it wrong when pad == eos and the text holds an eos). Other models (BERT-like encoders) use
``model(...).logits[:, 0]`` (their classifier already pools the first token).
"""

from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING, Callable, Literal, TypeVar

import torch

from lmppo.config import RewardSourceConfig
from lmppo.errors import RewardError
from lmppo.models.attention import use_cpu_attention
from lmppo.models.files import (
    ModelFolderError,
    check_json_file,
    check_model_folder,
    check_tokenizer_folder,
    load_whole,
)
from lmppo.models.parts import submodule
from lmppo.rewards.sources import RewardSource, SourceContext, register_reward_source

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Item = TypeVar("Item", str, list[int])
"""What a reward model scores: a text (`input: text`) or a sequence of token ids (`input: tokens`)."""

PICKLE_EXTENSIONS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@register_reward_source("model")
class ModelSource(RewardSource):
    """A sequence-classification model (one label) that scores each prompt + completion."""

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase  # the model's own (`input: text`) or the policy's (`input: tokens`)

    def __init__(self, cfg: RewardSourceConfig, ctx: SourceContext):
        super().__init__(cfg, ctx)
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        path = cfg.path
        if not os.path.isdir(path) and ctx.resolve_path is not None:
            path = ctx.resolve_path(path)
        where = f"reward model `{cfg.path}`"
        if not os.path.isdir(path):
            raise RewardError(
                f"{where}: no such folder (a reward model is a local folder holding a "
                "sequence-classification model and its tokenizer)"
            )
        has_safetensors = bool(glob.glob(os.path.join(path, "*.safetensors")))
        pickles = [f for f in os.listdir(path) if f.endswith(PICKLE_EXTENSIONS)]
        if not has_safetensors:
            if pickles and not ctx.allow_pickle:
                raise RewardError(
                    f"{where}: holds only pickle weights ({', '.join(sorted(pickles)[:3])}), which can "
                    "run arbitrary code; convert them to safetensors or set model.allow_pickle"
                )
            if not pickles:
                raise RewardError(f"{where}: holds no weights (*.safetensors)")

        try:  # a missing or invalid config.json: one error naming it
            check_json_file(path, "config.json", "reward model")
        except ModelFolderError as err:
            raise RewardError(str(err)) from None
        try:
            mcfg = AutoConfig.from_pretrained(path, trust_remote_code=ctx.trust_remote_code)
        except Exception as err:
            raise RewardError(f"{where}: cannot read its config.json: {type(err).__name__}: {err}") from err
        if getattr(mcfg, "num_labels", None) != 1:
            raise RewardError(
                f"{where}: has {getattr(mcfg, 'num_labels', '?')} labels; a reward model must have "
                "exactly one (num_labels=1, one score per text)"
            )
        try:  # a missing, empty, truncated or garbage file: one error naming it
            check_model_folder(path, "reward model", ctx.allow_pickle)
            check_tokenizer_folder(path, "reward model's tokenizer")
        except ModelFolderError as err:
            raise RewardError(str(err)) from None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=ctx.trust_remote_code)
        except Exception as err:
            raise RewardError(
                f"{where}: cannot load its tokenizer (the folder must hold the reward model's own "
                f"tokenizer): {type(err).__name__}: {err}"
            ) from err
        dtype = {"dtype": ctx.dtype} if ctx.dtype is not None else {}  # none given: the checkpoint's
        try:
            self.model = load_whole(
                AutoModelForSequenceClassification.from_pretrained,
                path,
                "reward model",
                ctx.strict,
                new_head=(),
                trust_remote_code=ctx.trust_remote_code,
                use_safetensors=has_safetensors,
                **dtype,
            )
        except ModelFolderError as err:
            raise RewardError(str(err)) from None
        except Exception as err:
            raise RewardError(
                f"{where}: cannot load it as a sequence-classification model: {type(err).__name__}: {err}"
            ) from err
        self._setup(mcfg, ctx, where)

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        name: str = "reward_model",
        ctx: SourceContext | None = None,
        input: Literal["text", "tokens"] = "tokens",
    ) -> ModelSource:
        """A source from a sequence-classification model object (one label), used as given (frozen, eval mode,
        moved to `ctx.device`), and the tokenizer its inputs are written in (copied: its padding settings are
        changed). `input` as `reward.sources[].input`: `tokens` reads the policy's sampled ids (then `tokenizer`
        must be the policy's), `text` re-encodes prompt + completion with `tokenizer`."""
        import copy

        ctx = ctx or SourceContext()
        self = cls.__new__(cls)
        RewardSource.__init__(self, RewardSourceConfig(kind="model", path="", name=name, input=input), ctx)
        where = f"reward model `{name}` ({type(model).__name__})"
        if getattr(model.config, "num_labels", None) != 1:
            raise RewardError(
                f"{where}: has {getattr(model.config, 'num_labels', '?')} labels; a reward model must "
                "have exactly one (num_labels=1, one score per text)"
            )
        self.model, self.tokenizer = model, copy.deepcopy(tokenizer)
        self._setup(model.config, ctx, where)
        return self

    def _setup(self, mcfg, ctx: SourceContext, where: str) -> None:
        """Freeze the loaded model, put it on its device and set up padding and the length limit."""
        self.model.eval().requires_grad_(False).to(ctx.device)
        tok = self.tokenizer
        tok.padding_side = "right"
        tok.truncation_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token or tok.unk_token
            if tok.pad_token is None:
                raise RewardError(f"{where}: its tokenizer has no pad, eos or unk token to pad batches with")
        limits = [
            n
            for n in (tok.model_max_length, getattr(mcfg, "max_position_embeddings", None))
            if isinstance(n, int) and 0 < n < 10**7
        ]
        self.max_length = min(limits) if limits else None
        self.batch_size = ctx.batch_size
        self.device = ctx.device
        self.autocast_dtype = ctx.autocast_dtype
        if torch.device(ctx.device).type == "cpu":
            use_cpu_attention(self.model)
        self.decoder_head = hasattr(self.model, "score") and hasattr(self.model, "base_model")
        self.wants_token_ids = self.cfg.input == "tokens"

    def __call__(
        self, prompts: list[str], completions: list[str], token_ids: list[list[int]] | None = None
    ) -> list[float]:
        if self.wants_token_ids:
            if token_ids is None:
                raise RewardError(
                    f"reward model `{self.name}` reads token ids (input: tokens); call it with "
                    "token_ids=[prompt ids + response ids, ...]"
                )
            return self._in_batches(token_ids, self.score_ids)
        return self._in_batches([p + c for p, c in zip(prompts, completions)], self.score_texts)

    def _in_batches(self, items: list[Item], score: Callable[[list[Item]], torch.Tensor]) -> list[float]:
        """`score` over `items` in batches of `batch_size` (0: all at once)."""
        step = self.batch_size or max(1, len(items))
        scores: list[float] = []
        for k in range(0, len(items), step):
            scores += score(items[k : k + step]).tolist()
        return scores

    @torch.inference_mode()
    def score_ids(self, sequences: list[list[int]]) -> torch.Tensor:
        """(N,) float32 score of each token-id sequence (`input: tokens`): right-padded, left-truncated to the
        model's length limit, the score read at the last real token."""
        if self.max_length is not None:
            sequences = [s[-self.max_length :] for s in sequences]
        width = max(len(s) for s in sequences)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences], device=self.device)
        attention_mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences], device=self.device)
        return self._scores(input_ids, attention_mask)

    @torch.inference_mode()
    def score_texts(self, texts: list[str]) -> torch.Tensor:
        """(N,) float32 score of each text."""
        enc = self.tokenizer(
            texts, return_tensors="pt", padding=True, truncation=self.max_length is not None, max_length=self.max_length
        )
        input_ids = enc["input_ids"].to(self.device)  # (N, L) right-padded
        attention_mask = enc["attention_mask"].to(self.device)  # (N, L)
        return self._scores(input_ids, attention_mask)

    def _scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with torch.autocast(
            input_ids.device.type, dtype=self.autocast_dtype or torch.bfloat16, enabled=self.autocast_dtype is not None
        ):
            return self._forward(input_ids, attention_mask).float().cpu()

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return sequence_scores(self.model, input_ids, attention_mask, self.decoder_head)


def sequence_scores(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, decoder_head: bool
) -> torch.Tensor:
    """(N,) score of each right-padded sequence (N, L): a decoder's `score` head read at the last real token
    (`decoder_head`), else the classifier's `logits[:, 0]`. `lmppo reward-model` trains through this same read."""
    if decoder_head:
        hidden = submodule(model, "base_model")(input_ids=input_ids, attention_mask=attention_mask)[0]  # (N, L, H)
        last = (attention_mask.sum(dim=-1) - 1).clamp(min=0)  # (N,) index of the last real token
        hidden_last = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # (N, H)
        return submodule(model, "score")(hidden_last)[:, 0]  # (N,)
    return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]  # (N,)
