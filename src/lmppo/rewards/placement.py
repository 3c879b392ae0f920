"""Put what a reward source returned for each response onto that response's tokens.

Design notes: docs/design.md, `lmppo.rewards.placement`."""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Literal, Sequence, TypeGuard, Union

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SKIP_SPECIAL_TOKENS = True
"""How a completion's tokens become its text (`decode(..., skip_special_tokens=True)`). The rollout must decode
``responses_text`` the same way (``decode_completion``), otherwise span offsets would point into a different
string."""
Span = tuple[int, int, float]
"""(start_char, end_char, value): a score on the characters [start, end) of the completion."""
ParsedOutput = Union[
    tuple[Literal["scalar"], float], tuple[Literal["tokens"], list[float]], tuple[Literal["spans"], list[Span]]
]
"""One response's output as `parse_output` checked it: a score, per-token scores, or spans."""

SPAN_PLACEMENTS = ("last", "spread")


class BadOutput(ValueError):
    """One response's reward output cannot be used (message says why)."""


def decode_completion(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    """The completion text of response tokens ``ids`` (stop token and padding already removed)."""
    text = tokenizer.decode(list(ids), skip_special_tokens=SKIP_SPECIAL_TOKENS)
    assert isinstance(text, str), "one sequence of ids decodes to one string"
    return text


def _common_prefix_len(a: str, b: str, hint: int) -> int:
    """len(os.path.commonprefix([a, b])), scanning from `hint` when a and b already agree up to it."""
    i = hint if a[:hint] == b[:hint] else 0
    n = min(len(a), len(b))
    while i < n and a[i] == b[i]:
        i += 1
    return i


def token_char_offsets(
    tokenizer: PreTrainedTokenizerBase,
    response_ids: Sequence[int],
    text: str | None = None,
    has_stop: bool | None = None,
) -> list[tuple[int, int]]:
    """Each response token's ``(start, end)`` character range in the completion text.

    ``response_ids`` are the real response tokens (no padding), ending with the stop token when the response
    has one. The completion text is ``decode_completion(tokenizer, ids)`` of the tokens before the stop token;
    pass it as ``text`` to check it (a mismatch raises ValueError). ``has_stop``: whether the last token is a
    stop token that is not part of the text; ``None`` infers it from ``text`` (False without ``text``).

    Naive equivalent: token k covers ``decode(ids[:k])[len(decode(ids[:k-1])):]``. Prefixes are compared
    against the final text instead, so that a token holding only part of a multi-byte character (its prefix
    ends in U+FFFD) covers the character it helps to build, and a decoder that rewrites earlier characters
    cannot produce ranges outside the text. Ranges may overlap (two byte tokens of one character both cover
    it); a token that produces no text (a skipped special token, the stop token) has an empty range, the stop
    token at ``(len(text), len(text))``.
    """
    ids = [int(t) for t in response_ids]
    if has_stop is None:
        has_stop = False
        if text is not None and ids and decode_completion(tokenizer, ids) != text:
            has_stop = decode_completion(tokenizer, ids[:-1]) == text
    text_ids = ids[:-1] if has_stop and ids else ids
    full = decode_completion(tokenizer, text_ids)
    if text is not None and full != text:
        raise ValueError(
            f"the completion text {text[:60]!r} is not the decoding of its tokens ({full[:60]!r}); "
            "decode responses with lmppo.rewards.placement.decode_completion"
        )
    prefixes = tokenizer.batch_decode(
        [text_ids[:k] for k in range(1, len(text_ids) + 1)], skip_special_tokens=SKIP_SPECIAL_TOKENS
    )
    offsets: list[tuple[int, int]] = []
    done = 0  # characters of `full` fully produced by the tokens so far
    for prefix in prefixes:
        common = _common_prefix_len(prefix, full, done)
        end = now = max(done, common)
        rest = prefix[common:]
        if rest and set(rest) == {"\ufffd"}:  # this token holds the first bytes of the next character
            end = min(len(full), now + 1)
        offsets.append((done, end))
        done = now
    if has_stop and ids:
        offsets.append((len(full), len(full)))
    return offsets


# ----------------------------------------------------------------------------- one output


def _is_number(x: object) -> TypeGuard[numbers.Real]:
    return isinstance(x, numbers.Real)


def _to_plain(x: object) -> object:
    """Tensors and numpy arrays as Python numbers / lists."""
    if isinstance(x, torch.Tensor) or type(x).__module__ == "numpy":
        to_list = getattr(x, "tolist", None)
        return to_list() if callable(to_list) else x
    return x


def _finite(x: object, what: str) -> float:
    if not _is_number(x):
        raise BadOutput(f"{what} is {x!r} of type {type(x).__name__}, not a number")
    v = float(x)
    if not math.isfinite(v):
        raise BadOutput(f"{what} is {v}, not finite")
    return v


def parse_output(out: object, num_tokens: int, text_len: int | None) -> ParsedOutput:
    """Check one response's output; return ``("scalar", v)``, ``("tokens", [v...])`` or ``("spans", [...])``.

    ``num_tokens``: real response tokens (stop token included); ``text_len``: characters of the completion
    (None when unknown; spans are then only checked for their form). Raises BadOutput saying what is wrong.
    """
    out = _to_plain(out)
    if _is_number(out):
        if num_tokens == 0:
            raise BadOutput("the response has no tokens to carry the score")
        return "scalar", _finite(out, "the score")
    if not isinstance(out, (list, tuple)):
        raise BadOutput(
            f"got {_short(out)} of type {type(out).__name__}; expected a number, a list of numbers "
            "(one per response token) or a list of (start_char, end_char, value) spans"
        )
    items = [_to_plain(x) for x in out]
    if items and all(_is_number(x) for x in items):
        if len(items) != num_tokens:
            raise BadOutput(
                f"per-token scores have length {len(items)}, the response has {num_tokens} tokens "
                "(stop token included; a function gets them as `completion_ids` when it has that "
                "parameter: re-encoding the text need not give back the sampled tokens)"
            )
        return "tokens", [_finite(x, f"per-token score [{j}]") for j, x in enumerate(items)]
    spans: list[Span] = []
    for j, s in enumerate(items):
        if not (isinstance(s, (list, tuple)) and len(s) == 3):
            raise BadOutput(
                f"item [{j}] is {_short(s)}; a list must hold only numbers (per-token scores) or only "
                "(start_char, end_char, value) spans"
            )
        start, end, value = s
        for name, pos in (("start_char", start), ("end_char", end)):
            if isinstance(pos, bool) or not (
                isinstance(pos, numbers.Integral) or (isinstance(pos, float) and pos.is_integer())
            ):
                raise BadOutput(f"span [{j}] {_short(s)}: {name} {pos!r} is not an integer")
        start, end = int(start), int(end)
        if start < 0 or start > end or (text_len is not None and end > text_len):
            limit = (
                f"0 <= start <= end <= {text_len} (the completion's length)"
                if text_len is not None
                else "0 <= start <= end"
            )
            raise BadOutput(f"span [{j}] {_short(s)} is outside the text: need {limit}")
        spans.append((start, end, _finite(value, f"span [{j}] value")))
    return "spans", spans


def _short(x: object, n: int = 80) -> str:
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."


def place_one(
    parsed: ParsedOutput,
    num_tokens: int,
    width: int,
    offsets: Sequence[tuple[int, int]] | None = None,
    span_placement: str = "last",
) -> torch.Tensor:
    """(width,) float32 scores of one response from its parsed output (``parse_output``)."""
    row = torch.zeros(width, dtype=torch.float32)
    if parsed[0] == "scalar":
        row[num_tokens - 1] = parsed[1]
    elif parsed[0] == "tokens":
        row[:num_tokens] = torch.tensor(parsed[1], dtype=torch.float32)
    else:
        if span_placement not in SPAN_PLACEMENTS:
            raise ValueError(f"span_placement {span_placement!r}: must be one of {SPAN_PLACEMENTS}")
        if not parsed[1]:
            return row
        if offsets is None:
            raise ValueError("span outputs need the token offsets of the response")
        for start, end, value in parsed[1]:
            tokens = _tokens_covering(offsets, start, end, num_tokens)
            if span_placement == "last":
                row[tokens[-1]] += value
            else:
                row[tokens] += value / len(tokens)
    return row


def _tokens_covering(offsets: Sequence[tuple[int, int]], start: int, end: int, num_tokens: int) -> list[int]:
    """Indices of the tokens whose character range overlaps [start, end).

    An empty span (start == end) goes to the token holding character `start`; with none (the span sits at the
    end of the text) to the last real token.
    """
    hit = [k for k, (a, b) in enumerate(offsets[:num_tokens]) if a < end and b > start]
    if not hit:
        hit = [next((k for k, (a, b) in enumerate(offsets[:num_tokens]) if b > start), num_tokens - 1)]
    return hit


def place_scores(
    outputs: Sequence[object],
    response_mask: torch.Tensor,
    offsets: Sequence[Sequence[tuple[int, int]] | None] | None = None,
    span_placement: str = "last",
) -> torch.Tensor:
    """(B, T) float32 per-token scores from one output per response; zero wherever ``response_mask`` is False.

    ``response_mask``: (B, T) bool, real response tokens (stop token included), right-padded.
    ``offsets[i]``: ``token_char_offsets`` of response i, needed only where output i has spans.
    A bad output raises ValueError naming the sample.
    """
    mask = response_mask.bool()
    if len(outputs) != mask.shape[0]:
        raise ValueError(f"got {len(outputs)} outputs for {mask.shape[0]} responses")
    lengths = mask.sum(dim=1).tolist()
    rows = []
    for i, out in enumerate(outputs):
        off = offsets[i] if offsets is not None else None
        text_len = max((b for _, b in off), default=0) if off is not None else None
        try:
            parsed = parse_output(out, lengths[i], text_len)
        except BadOutput as err:
            raise ValueError(f"sample {i}: {err}") from None
        rows.append(place_one(parsed, lengths[i], mask.shape[1], off, span_placement))
    scores = torch.stack(rows) if rows else torch.zeros(mask.shape, dtype=torch.float32)
    return scores.to(response_mask.device) * mask
