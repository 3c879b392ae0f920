"""A custom reward written as a plain Python function, used by `examples/custom_reward/recipe.yaml`.

A reward function takes the batch's prompts and completions (text) and returns one output per completion:

- a number (the usual case; it lands on the response's last token),
- a list of numbers, one per response token, or
- a list of character spans ``(start_char, end_char, value)`` over the completion; lmppo maps them onto the
  policy's tokens itself, so the function never needs the tokenizer.

It must not change its inputs, and should be deterministic. It runs in the training process, once per batch.
A config names it as ``path/to/file.py:function`` (or ``package.module:function`` for an installed module):

    reward:
      sources:
        - {kind: function, path: "examples/custom_reward/reward.py:warm_and_on_topic", name: warm}

This one asks for continuations of movie-review openings that are warm *and* stay on the prompt's subject,
and punishes the repetition a policy falls into when it games a word-list reward. No package beyond the
standard library is needed.
"""

from __future__ import annotations

import re

WARM_WORDS = frozenset(
    """
    good great fine lovely wonderful beautiful brilliant charming delightful enjoyable fun funny moving touching
    warm tender kind gentle sweet smart clever witty fresh vivid rich memorable remarkable superb solid strong
    engaging gripping honest heartfelt joyful pleasant impressive inspiring thoughtful elegant graceful love
    loved loves enjoy enjoyed like liked admire admired best better
""".split()
)
"""Words that earn the warmth bonus (lower case)."""

STOP_WORDS = frozenset(
    """
    a an the and or but if of to in on at by for with from as is are was were be been being it its this that
    these those he she they we you i his her their our your my me him them us not no so than too very just
""".split()
)

_WORD = re.compile(r"[A-Za-z']+")


def _words(text: str) -> list[str]:
    return [w.lower().strip("'") for w in _WORD.findall(text)]


def warm_and_on_topic(prompts: list[str], completions: list[str]) -> list[float]:
    """Per completion, in about [-1, 1.5]:

    + 0.35 per distinct warm word (at most 1.0): the sentiment signal;
    + 0.5 when the completion reuses a content word of the prompt (not a stop word): stays on topic;
    - 1.0 * the fraction of repeated word trigrams: "great great great ..." earns nothing;
    - 0.5 for an empty completion.
    """
    scores = []
    for prompt, completion in zip(prompts, completions):
        words = _words(completion)
        if not words:
            scores.append(-0.5)
            continue
        warmth = min(0.35 * len(set(words) & WARM_WORDS), 1.0)
        topic = {w for w in _words(prompt) if w not in STOP_WORDS and len(w) > 2}
        on_topic = 0.5 if topic & set(words) else 0.0
        trigrams = list(zip(words, words[1:], words[2:]))
        repeats = (len(trigrams) - len(set(trigrams))) / len(trigrams) if trigrams else 0.0
        scores.append(warmth + on_topic - repeats)
    return scores


def warm_word_spans(prompts: list[str], completions: list[str]) -> list[list[tuple[int, int, float]]]:
    """The span-level variant: +0.35 on the characters of each warm word (first occurrence only), so the credit
    lands on the tokens that earned it instead of on the last token. Use it as a second source, or instead of
    `warm_and_on_topic`, with `span_placement: spread` or `last`."""
    out = []
    for completion in completions:
        seen: set[str] = set()
        spans = []
        for m in _WORD.finditer(completion):
            w = m.group().lower().strip("'")
            if w in WARM_WORDS and w not in seen:
                seen.add(w)
                spans.append((m.start(), m.end(), 0.35))
        out.append(spans)
    return out
