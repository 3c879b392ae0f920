"""Preference pairs for training a reward model, in TRL's preference format: rows with `chosen` and `rejected`, and
an optional `prompt`; each either text (strings) or chat (lists of {"role", "content"} messages, the prompt then
the user's turns and `chosen` / `rejected` the assistant's answer), and an optional `margin` (a number, TRL's
margin column). Read from the sources `data.prompts` takes: a
.jsonl file, a `datasets` folder (save_to_disk), a .parquet or .arrow file, a built-in set (`BUILTIN_PAIRS`), or
a list of rows through the Python API."""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass
from typing import Any, Sequence, Union

from lmppo.data.hf_datasets import dataset_format, is_hf_dataset, load_dataset_path
from lmppo.errors import DataError
from lmppo.models.assets import polarity_continuations, polarity_sentences

Side = Union[str, list]
"""One side of a pair: a text, or a list of chat messages."""


@dataclass(frozen=True)
class PreferencePair:
    chosen: Side
    rejected: Side
    prompt: Side | None = None
    origin: tuple[str, ...] = ()
    """Texts the pair was made from besides its two responses (a built-in set's sentences): a held-out split
    never trains a pair that shares a response or an origin with a held-out pair."""
    margin: float | None = None
    """TRL's `margin` column: how much higher the chosen side should score (subtracted inside the loss)."""


def builtin_polarity_pairs() -> list[PreferencePair]:
    """`builtin:polarity`: the 200 labelled sentences of gensim's `pang_lee_polarity.cor` (the corpus of the default
    recipe's prompts) as 100 text pairs, the i-th positive sentence chosen over the i-th negative one (no prompt),
    each sentence in one pair only: a reward model of positive sentiment. Whole sentences teach sentiment best
    (docs/stages.md), but such a model never sees a fragment; `builtin:polarity-continuations` continues it."""
    texts, labels = polarity_sentences()
    positive = [t for t, label in zip(texts, labels) if label == 1]
    negative = [t for t, label in zip(texts, labels) if label == 0]
    return [PreferencePair(chosen=p, rejected=n) for p, n in zip(positive, negative)]


POLARITY_PAIRS_PER_SENTENCE = 3
"""`builtin:polarity-continuations`: how many negative continuations each positive one is paired with."""


def builtin_polarity_continuation_pairs() -> list[PreferencePair]:
    """`builtin:polarity-continuations`: the sentences of `builtin:polarity` shaped as PPO will use a reward model
    of positive sentiment.

    Each labelled sentence is split as ``builtin:reviews`` splits it: its opening (a prompt of the default
    recipe) and its continuation, cut to 8-18 words (a checksum of the text picks the cut; the policy writes 24
    tokens). A pair prefers a positive continuation to a negative one **under the same prompt**, the opening of one
    of the two sentences (in turn, so the prompt's own continuation is chosen in half the pairs and rejected in the
    other half): only the continuation, what the policy writes, tells chosen from rejected. The two sides are
    length-matched (word counts at most one apart, both cut or both whole sentences), so length and completeness
    carry no preference. Each positive continuation is paired with up to `POLARITY_PAIRS_PER_SENTENCE` negative
    ones, the negatives used in turn: 314 pairs, each continuation in several. A pair's `origin` is the two
    corpus lines its continuations come from (what `builtin:polarity` pairs as whole responses)."""
    # label -> (opening, fragment, words, cut, line)
    units: dict[int, list[tuple[str, str, int, bool, str]]] = {0: [], 1: []}
    for opening, continuation, label, line in polarity_continuations():
        words = continuation.split()
        keep = min(len(words), 8 + zlib.crc32(continuation.encode("utf-8")) % 11)
        units[label].append((opening, " " + " ".join(words[:keep]), keep, keep < len(words), line))
    pairs: list[PreferencePair] = []
    next_negative = 0
    for p_opening, p_text, p_words, p_cut, p_line in units[1]:
        matched = [n for n in range(len(units[0])) if abs(units[0][n][2] - p_words) <= 1 and units[0][n][3] == p_cut]
        # the negatives in turn from where the last positive stopped, so each is used about as often
        matched.sort(key=lambda n: (n - next_negative) % len(units[0]))
        for n in matched[:POLARITY_PAIRS_PER_SENTENCE]:
            n_opening, n_text, _, _, n_line = units[0][n]
            prompt = p_opening if len(pairs) % 2 == 0 else n_opening
            pairs.append(PreferencePair(chosen=p_text, rejected=n_text, prompt=prompt, origin=(p_line, n_line)))
            next_negative = n + 1
    return pairs


def builtin_polarity_mixed_pairs() -> list[PreferencePair]:
    """`builtin:polarity-mixed` (the default of `lmppo reward-model`): the pairs of `builtin:polarity` then those of
    `builtin:polarity-continuations`, trained together. The whole sentences teach sentiment (the continuations
    alone did not learn it); the continuations, under the recipe's prompts, teach it on the unfinished texts PPO
    scores (whole sentences alone left a model that scores any fragment high). docs/stages.md has the figures."""
    return builtin_polarity_pairs() + builtin_polarity_continuation_pairs()


BUILTIN_PAIRS = {
    "polarity-mixed": builtin_polarity_mixed_pairs,
    "polarity": builtin_polarity_pairs,
    "polarity-continuations": builtin_polarity_continuation_pairs,
}


def load_preference_pairs(source: str | Sequence[Any]) -> list[PreferencePair]:
    """The checked pairs of `source` (see the module docstring); one DataError naming the source, the row and the
    field for anything wrong."""
    if not isinstance(source, str):
        if is_hf_dataset(source):
            return _checked([dict(r) for r in source], "the datasets.Dataset passed to the API")
        return _checked(list(source), "the rows passed to the API")
    if source.startswith("builtin:"):
        name = source[len("builtin:") :]
        if name not in BUILTIN_PAIRS:
            raise DataError(f"preference set `{source}`: the built-in sets are " + ", ".join(BUILTIN_PAIRS))
        return BUILTIN_PAIRS[name]()
    if not os.path.exists(source):
        raise DataError(
            f"preference data `{source}` does not exist (a .jsonl file, a datasets folder, a .parquet / .arrow "
            "file, or " + ", ".join(f"`builtin:{n}`" for n in BUILTIN_PAIRS) + ")"
        )
    fmt = dataset_format(source, "auto")
    if fmt is not None:
        return _checked([dict(r) for r in load_dataset_path(source, fmt)], f"preference data `{source}`")
    if not source.lower().endswith(".jsonl"):
        raise DataError(f"preference data `{source}`: takes .jsonl, .parquet, .arrow or a datasets folder")
    rows = []
    with open(source, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataError(f"preference data `{source}`, line {number}: not JSON ({err.msg})") from None
    return _checked(rows, f"preference data `{source}`")


def _checked(rows: list, source: str) -> list[PreferencePair]:
    if not rows:
        raise DataError(f"{source}: holds no preference pairs")
    pairs = []
    for i, row in enumerate(rows):
        where = f"{source}, row {i + 1}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: is a {type(row).__name__}; a row is a mapping with `chosen` and `rejected`")
        for name in ("chosen", "rejected"):
            if name not in row:
                have = ", ".join(f"`{k}`" for k in row) or "no fields"
                raise DataError(f"{where}: has no field `{name}` (it has {have}); rows are TRL's preference format")
        sides = {name: row.get(name) for name in ("chosen", "rejected", "prompt")}
        for name, value in sides.items():
            if value is None and name == "prompt":
                continue
            if not (isinstance(value, str) and value.strip()) and not _is_chat(value):
                raise DataError(f"{where}: `{name}` must be a non-empty text or a list of chat messages")
        if _is_chat(sides["chosen"]) != _is_chat(sides["rejected"]):
            raise DataError(f"{where}: `chosen` and `rejected` must both be text or both chat messages")
        margin = row.get("margin")
        if margin is not None and (
            isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin)
        ):
            raise DataError(f"{where}: `margin` must be a finite number (TRL's margin column), not {margin!r}")
        pairs.append(PreferencePair(**sides, margin=None if margin is None else float(margin)))
    return pairs


def _is_chat(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value)
    )


def pair_texts(pair: PreferencePair, tokenizer: Any) -> tuple[str, str]:
    """(chosen text, rejected text) as the reward model reads them: the prompt, then the answer. Chat pairs go
    through the tokenizer's chat template (a text prompt becomes one user message)."""
    if not _is_chat(pair.chosen):
        prompt = pair.prompt if isinstance(pair.prompt, str) else ""
        return prompt + str(pair.chosen), prompt + str(pair.rejected)
    if pair.prompt is None:
        prompt: list = []
    elif isinstance(pair.prompt, str):
        prompt = [{"role": "user", "content": pair.prompt}]
    else:
        prompt = list(pair.prompt)
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("chat preference pairs need a tokenizer with a chat template; this one has none")
    return tuple(  # type: ignore[return-value]
        tokenizer.apply_chat_template(prompt + list(side), tokenize=False) for side in (pair.chosen, pair.rejected)
    )
