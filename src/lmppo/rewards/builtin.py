"""Built-in reward functions, each returning one float per completion.

Design notes: docs/design.md, `lmppo.rewards.builtin`."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypedDict

from lmppo.errors import LmppoError, RewardError
from lmppo.models.assets import cache_dir, minilm_path, polarity_sentences
from lmppo.models.cache import fill_file
from lmppo.models.files import load_whole
from lmppo.rewards.tasks import reasoning_gym

if TYPE_CHECKING:  # torch and transformers are imported when a MiniLM reward is first called
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class PolarityScorer(Protocol):
    """vaderSentiment's `SentimentIntensityAnalyzer` (the package ships no types)."""

    def polarity_scores(self, text: str) -> dict[str, float]: ...


class JudgeHead(TypedDict):
    """The MiniLM sentiment judge's logistic head and how well it does (`_train_head`; cached with torch.save)."""

    weight: torch.Tensor  # (384,)
    bias: torch.Tensor  # ()
    heldout_accuracy: float
    train_accuracy: float
    num_sentences: int


log = logging.getLogger(__name__)

__all__ = [
    "exact_match",
    "reasoning_gym",
    "final_answer",
    "vader_sentiment",
    "minilm_sentiment",
    "minilm_summary",
    "minilm_sentiment_info",
    "minilm_relevance",
    "minilm_self_similarity",
    "embed",
]

MAX_TOKENS = 256
"""MiniLM input length in word pieces (all-MiniLM-L6-v2 was trained with 256); longer text is cut."""
SUMMARY_MIN_WORDS = 8
"""``minilm_summary``: completions with fewer words than this are penalised ..."""
SUMMARY_SHORT_PENALTY = 0.2
"""... by up to this much: penalty = SUMMARY_SHORT_PENALTY * (1 - words / SUMMARY_MIN_WORDS), 0 at 8+ words."""

# Judge head hyper-parameters (changing any of them changes the disk-cache key).
_L2 = 3e-3  # strength of the pull of the weights towards the prior direction
_PRIOR_SCALE = 10.0  # length of the prior weight vector (the embeddings are unit vectors)
_FOLDS = 5
_HEAD_FORMAT = 1
# A prior for the head: the direction from the mean embedding of these negative sentences to the mean of the
# positive ones. It is generic sentiment (not movie trivia) and adds about 3 points of held-out accuracy over a
# plain L2-regularised head with 200 training sentences.
_PRIOR_POS = (
    "This movie is wonderful, I loved it.",
    "A great, moving and beautiful film.",
    "Brilliant acting and a delightful story.",
    "I really enjoyed it, highly recommended.",
    "A funny, charming and smart comedy.",
    "One of the best films of the year.",
)
_PRIOR_NEG = (
    "This movie is terrible, I hated it.",
    "A boring, dull and ugly film.",
    "Awful acting and a stupid story.",
    "I really disliked it, a waste of time.",
    "A tedious, silly and pointless comedy.",
    "One of the worst films of the year.",
)


# ----------------------------------------------------------------------------- verifiable: exact match

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def final_answer(text: str) -> str:
    """The final answer of a completion: after the last `####`, else inside the last `\\boxed{...}`, else the last
    number, else the whole text (stripped)."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else text.strip()


def _normalize_answer(answer: str) -> str:
    a = answer.strip().strip(" .,;:!\"'`$").lower()
    number = _NUMBER.fullmatch(a)
    if number:
        try:
            v = float(a.replace(",", ""))
            return repr(int(v)) if v.is_integer() else repr(v)
        except ValueError:
            pass
    return " ".join(a.split())


def exact_match(completions: list[str], solution: list[object], **kwargs: object) -> list[float]:
    """1.0 where the completion's final answer (``final_answer``) equals the prompt's ``solution``, else 0.0.

    Called by keyword (TRL's convention): ``solution`` is the column of that name of the prompt data."""
    if len(solution) != len(completions):
        raise RewardError(f"exact_match: {len(completions)} completions but {len(solution)} solutions")
    out = []
    for c, sol in zip(completions, solution):
        got = _normalize_answer(final_answer(c))
        want = _normalize_answer(final_answer(str(sol)) if isinstance(sol, str) else str(sol))
        out.append(1.0 if got and got == want else 0.0)
    return out


def number_only(completions: list[str], **kwargs: object) -> list[float]:
    """A format reward: 1.0 where the completion, stripped of surrounding whitespace, is one number as
    ``final_answer`` reads numbers (``42``, ``-7``, ``3.5``, ``1,200``) and nothing else, else 0.0. Beside
    ``exact_match`` as a second source with a small weight, it pays for the answer format even while the answer
    is wrong (docs/choosing.md, "GRPO-style knobs")."""
    return [1.0 if _NUMBER.fullmatch(c.strip()) else 0.0 for c in completions]


# ----------------------------------------------------------------------------- VADER


def vader_sentiment(prompts: list[str], completions: list[str]) -> list[float]:
    """VADER compound sentiment of each completion (the prompt is ignored), in [-1, 1]; 0 for empty text."""
    _check(prompts, completions, "vader_sentiment")
    analyzer = _vader()
    return [float(analyzer.polarity_scores(c)["compound"]) if c.strip() else 0.0 for c in completions]


@lru_cache(maxsize=1)
def _vader() -> PolarityScorer:
    try:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    except ImportError:
        raise LmppoError(
            "the reward `vader_sentiment` needs the package `vaderSentiment`; install it with: "
            "pip install vaderSentiment"
        ) from None
    return SentimentIntensityAnalyzer()


# ----------------------------------------------------------------------------- MiniLM encoder


@lru_cache(maxsize=1)
def _minilm() -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    path = minilm_path()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch  # noqa: F401
        from transformers import AutoModel, AutoTokenizer
    except ImportError:
        raise LmppoError(
            "the MiniLM rewards need `torch` and `transformers`; install them with: pip install torch transformers"
        ) from None
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = load_whole(AutoModel.from_pretrained, path, "MiniLM judge", strict=True, local_files_only=True)
    return tokenizer, model.eval()


def embed(texts: list[str], batch_size: int = 64) -> torch.Tensor:
    """(N, 384) float32 CPU tensor: mean-pooled (over real tokens), L2-normalised all-MiniLM-L6-v2 embeddings,
    as sentence-transformers computes them for this model."""
    import torch

    tokenizer, model = _minilm()
    out = []
    with torch.inference_mode():
        for i in range(0, len(texts), batch_size):
            batch = tokenizer(
                list(texts[i : i + batch_size]),
                padding=True,
                truncation=True,
                max_length=MAX_TOKENS,
                return_tensors="pt",
            )
            hidden = model(**batch).last_hidden_state  # (b, L, 384)
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (b, L, 1)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (b, 384)
            out.append(torch.nn.functional.normalize(pooled.float(), dim=-1))
    return torch.cat(out) if out else torch.zeros(0, 384)


# ----------------------------------------------------------------------------- MiniLM sentiment judge


def minilm_sentiment(prompts: list[str], completions: list[str]) -> list[float]:
    """P(positive) - 0.5 for each completion (the prompt is ignored), in [-0.5, 0.5].

    The probability comes from a logistic regression on MiniLM embeddings, trained on the 200 labelled
    sentences of gensim's `pang_lee_polarity.cor` (see ``minilm_sentiment_info()`` for its held-out accuracy).
    """
    _check(prompts, completions, "minilm_sentiment")
    if not completions:
        return []
    import torch

    head = _judge_head()
    logits = embed(completions) @ head["weight"] + head["bias"]  # (N,)
    return (torch.sigmoid(logits) - 0.5).tolist()


def minilm_sentiment_info() -> dict[str, float]:
    """The judge head's held-out accuracy (mean over a seeded 5-fold split of the 200 sentences), the training
    accuracy, and the number of training sentences."""
    head = _judge_head()
    return {
        "heldout_accuracy": float(head["heldout_accuracy"]),
        "train_accuracy": float(head["train_accuracy"]),
        "num_sentences": int(head["num_sentences"]),
    }


@lru_cache(maxsize=1)
def _judge_head() -> JudgeHead:
    """The trained head, from the disk cache when its key matches, else trained (seconds) and cached."""
    import torch

    texts, labels = polarity_sentences()
    model_dir = Path(minilm_path())
    key_src = json.dumps(
        {
            "texts": texts,
            "labels": labels,
            "pos": _PRIOR_POS,
            "neg": _PRIOR_NEG,
            "l2": _L2,
            "scale": _PRIOR_SCALE,
            "folds": _FOLDS,
            "format": _HEAD_FORMAT,
            "max_tokens": MAX_TOKENS,
            "config": (model_dir / "config.json").read_text(),
            "weights": _file_size(model_dir / "model.safetensors"),
        }
    )
    key = hashlib.sha256(key_src.encode("utf-8")).hexdigest()[:16]
    path = cache_dir() / "judges" / f"minilm_sentiment-{key}.pt"
    trained: list[JudgeHead] = []  # the head this process trained, if it did

    def build(tmp: Path) -> None:
        trained.append(_train_head(texts, labels))
        torch.save(trained[0], tmp)

    try:  # one process trains and writes the head; others started at the same time wait for it
        fill_file(path, build, lambda p: _cached_head(p) is not None, "the MiniLM judge head")
    except OSError as err:  # a read-only cache only costs the seconds of retraining
        log.warning("could not cache the MiniLM judge at %s (%s)", path, err)
        return trained[0] if trained else _train_head(texts, labels)
    return trained[0] if trained else _cached_head(path) or _train_head(texts, labels)


def _cached_head(path: Path) -> JudgeHead | None:
    """The head in the cache file `path`, or None when it is missing or unreadable (then it is rebuilt)."""
    import torch

    if not path.is_file():
        return None
    try:
        head = torch.load(path, weights_only=True)
    except Exception as err:  # a corrupt cache file is rebuilt, never fatal
        log.warning("ignoring unreadable judge cache %s (%s)", path, err)
        return None
    if not (isinstance(head, dict) and set(JudgeHead.__annotations__) <= set(head)):
        return None
    return JudgeHead(
        weight=head["weight"],
        bias=head["bias"],
        heldout_accuracy=float(head["heldout_accuracy"]),
        train_accuracy=float(head["train_accuracy"]),
        num_sentences=int(head["num_sentences"]),
    )


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _train_head(texts: list[str], labels: list[int]) -> JudgeHead:
    """Logistic regression on the embeddings with an L2 pull towards a prior direction (full-batch L-BFGS from
    the prior: deterministic), evaluated by 5-fold cross-validation, then refit on all sentences."""
    import torch

    x = embed(texts)  # (N, 384)
    y = torch.tensor(labels, dtype=torch.float32)  # (N,)
    direction = embed(list(_PRIOR_POS)).mean(0) - embed(list(_PRIOR_NEG)).mean(0)
    prior = _PRIOR_SCALE * direction / direction.norm()  # (384,)

    n = len(texts)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    folds = perm.chunk(_FOLDS)
    correct = 0
    for k, test in enumerate(folds):
        train = torch.cat([f for j, f in enumerate(folds) if j != k])
        w, b = _fit_logistic(x[train], y[train], prior)
        correct += int(((x[test] @ w + b > 0).float() == y[test]).sum())
    w, b = _fit_logistic(x, y, prior)
    train_acc = float(((x @ w + b > 0).float() == y).float().mean())
    return JudgeHead(weight=w, bias=b, heldout_accuracy=correct / n, train_accuracy=train_acc, num_sentences=n)


def _fit_logistic(x: torch.Tensor, y: torch.Tensor, prior: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """argmin_w,b  BCE(x @ w + b, y) + _L2 * ||w - prior||^2."""
    import torch

    w = prior.clone().requires_grad_(True)
    b = torch.zeros((), requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=300, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y) + _L2 * (w - prior).pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return w.detach(), b.detach()


# ----------------------------------------------------------------------------- MiniLM summary similarity

_CHAT_MARK = re.compile(r"<\|[^|<>]{1,40}\|>(?:system|user|assistant)?")
_TLDR = re.compile(r"\s*(?:TL;\s*DR|Summary)\s*:\s*$", re.IGNORECASE)


def minilm_summary(prompts: list[str], completions: list[str]) -> list[float]:
    """cos(MiniLM(article), MiniLM(summary)) - short penalty, roughly in [-0.4, 1].

    The article is the prompt with chat-template markers (``<|...|>``) and a trailing ``TL;DR:`` removed. The
    penalty is ``SUMMARY_SHORT_PENALTY * (1 - words / SUMMARY_MIN_WORDS)`` for completions under
    ``SUMMARY_MIN_WORDS`` words (an empty completion loses the full 0.2), so that one or two on-topic words do
    not win. Caveat: copying the article verbatim also scores high; keep a KL penalty and read the samples.
    """
    _check(prompts, completions, "minilm_summary")
    if not completions:
        return []
    articles = [_TLDR.sub("", _CHAT_MARK.sub(" ", p)).strip() for p in prompts]
    a = embed(articles)  # (N, 384), unit rows
    s = embed(completions)  # (N, 384)
    cosine = (a * s).sum(-1).tolist()
    out = []
    for cos, text in zip(cosine, completions):
        words = len(text.split())
        penalty = SUMMARY_SHORT_PENALTY * max(0.0, 1.0 - words / SUMMARY_MIN_WORDS)
        out.append(float(cos) - penalty)
    return out


# ----------------------------------------------------------------------------- reward-hacking checks (judges)


def minilm_relevance(prompts: list[str], completions: list[str]) -> list[float]:
    """Prompt-relevance gap of each completion: cos(completion, its prompt) minus the mean cos(completion, q) over
    the call's other distinct prompts q (MiniLM embeddings, chat-template markers removed), roughly in [-1, 1].

    About 0.1 for an on-topic base model; it falls toward 0 when completions drift into text that fits any prompt,
    a common way a learned reward is over-optimised. Relative to the call's prompts: 0.0 for every completion
    when the call has a single distinct prompt. Log it with weight 0 (a judge, never trained on)."""
    _check(prompts, completions, "minilm_relevance")
    if not completions:
        return []
    import torch

    unique = sorted(set(prompts))
    if len(unique) < 2:
        return [0.0] * len(completions)
    p = embed([_CHAT_MARK.sub(" ", x).strip() for x in unique])  # (P, 384), unit rows
    c = embed(completions)  # (N, 384)
    sim = c @ p.T  # (N, P)
    own = torch.tensor([unique.index(x) for x in prompts])
    mine = sim[torch.arange(len(completions)), own]
    others = (sim.sum(1) - mine) / (len(unique) - 1)
    return (mine - others).tolist()


def minilm_self_similarity(prompts: list[str], completions: list[str]) -> list[float]:
    """Mean cos(completion, c) over the call's completions c of other prompts (MiniLM embeddings), in [-1, 1].

    About 0.1 for a base model on varied prompts; it rises toward 1 when completions collapse onto one phrasing
    whatever the prompt (mode collapse under an over-optimised reward). Completions of the same prompt are left
    out, so several samples per prompt do not raise it. 0.0 for every completion when the call has a single
    distinct prompt. Log it with weight 0 (a judge, never trained on)."""
    _check(prompts, completions, "minilm_self_similarity")
    if not completions:
        return []
    import torch

    if len(set(prompts)) < 2:
        return [0.0] * len(completions)
    c = embed(completions)  # (N, 384), unit rows
    ids = {x: i for i, x in enumerate(sorted(set(prompts)))}
    group = torch.tensor([ids[x] for x in prompts])
    other = (group[:, None] != group[None, :]).float()  # (N, N): 1 where the two prompts differ
    return ((c @ c.T * other).sum(1) / other.sum(1)).tolist()


minilm_self_similarity.watch = "rises as completions collapse onto one phrasing"  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- checks


def _check(prompts: list[str], completions: list[str], name: str) -> None:
    if len(prompts) != len(completions):
        raise RewardError(
            f"{name}: got {len(prompts)} prompts but {len(completions)} completions; they must pair up one to one"
        )
    for i, c in enumerate(completions):
        if not isinstance(c, str):
            raise RewardError(f"{name}: completion {i} is a {type(c).__name__}, not a string: {c!r:.80}")
