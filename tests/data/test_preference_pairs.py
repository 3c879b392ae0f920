"""lmppo.data.preference_pairs: TRL's preference format read from files, datasets and the built-in set; checked row
by row; turned into the texts a reward model reads."""

from __future__ import annotations

import json

import pytest

from lmppo.data.preference_pairs import (
    PreferencePair,
    builtin_polarity_continuation_pairs,
    builtin_polarity_mixed_pairs,
    builtin_polarity_pairs,
    load_preference_pairs,
    pair_texts,
)
from lmppo.errors import DataError
from lmppo.models.assets import builtin_prompts, polarity_continuations, polarity_sentences


def test_the_builtin_set_prefers_each_positive_sentence_to_a_negative_one():
    pairs = load_preference_pairs("builtin:polarity")
    texts, labels = polarity_sentences()
    label = dict(zip(texts, labels))
    assert len(pairs) == 100 == len(builtin_polarity_pairs())
    assert all(label[p.chosen] == 1 and label[p.rejected] == 0 and p.prompt is None for p in pairs)
    used = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    assert len(set(used)) == 200  # each sentence in one pair only: a held-out split shares none with training


def test_the_continuation_set_prefers_positive_continuations_under_the_recipes_prompts():
    """Pairs as PPO will use the model: a prompt of `builtin:reviews`, a positive and a negative continuation of
    the same length (and completeness), the prompt's own continuation chosen in half the pairs, rejected in the
    other half; hundreds of pairs, not one per sentence."""
    pairs = load_preference_pairs("builtin:polarity-continuations")
    assert len(pairs) == len(builtin_polarity_continuation_pairs()) == 314  # not one pair per sentence
    prompts = set(builtin_prompts("reviews"))
    own = {(opening, " " + continuation): label for opening, continuation, label, _ in polarity_continuations()}
    label_of = {}  # a side's text -> {(the label of the sentence it continues, whether it is all of the rest)}
    for (opening, continuation), label in own.items():
        words = continuation.split()
        for keep in range(1, len(words) + 1):
            label_of.setdefault(" ".join(words[:keep]), set()).add((label, keep == len(words)))
    chosen_own = rejected_own = 0
    for p in pairs:
        assert p.prompt in prompts and not p.chosen.strip().startswith(p.prompt)
        ((chosen_label, chosen_whole),) = label_of[p.chosen.strip()]
        ((rejected_label, rejected_whole),) = label_of[p.rejected.strip()]
        assert (chosen_label, rejected_label) == (1, 0), p
        assert abs(len(p.chosen.split()) - len(p.rejected.split())) <= 1, p  # length-matched
        assert chosen_whole == rejected_whole, p  # both cut, or both the whole rest of their sentence
        chosen_own += any(o == p.prompt and c.startswith(p.chosen) for o, c in own)
        rejected_own += any(o == p.prompt and c.startswith(p.rejected) for o, c in own)
    assert chosen_own + rejected_own >= len(pairs) and abs(chosen_own - rejected_own) <= 0.1 * len(pairs)


def test_continuation_pairs_name_the_corpus_lines_they_were_cut_from():
    """`origin` is what lets the held-out split keep a sentence out of training whole and cut alike."""
    lines = {line for opening, continuation, label, line in polarity_continuations()}
    texts, labels = polarity_sentences()
    label = dict(zip(texts, labels))
    for p in builtin_polarity_continuation_pairs():
        chosen_line, rejected_line = p.origin
        assert p.chosen.strip() in chosen_line and p.rejected.strip() in rejected_line
        assert {chosen_line, rejected_line} <= lines and (label[chosen_line], label[rejected_line]) == (1, 0)
        assert p.prompt.rstrip(",;:-")[1:] in chosen_line + rejected_line  # the opening of one of the two lines
    assert all(p.origin == () for p in builtin_polarity_pairs())  # their responses are the lines themselves


def test_the_default_set_is_the_whole_sentences_and_the_continuations():
    mixed = load_preference_pairs("builtin:polarity-mixed")
    assert mixed == builtin_polarity_mixed_pairs() == builtin_polarity_pairs() + builtin_polarity_continuation_pairs()
    assert len(mixed) == 414 and sum(p.prompt is None for p in mixed) == 100


def test_jsonl_text_and_chat_rows(tmp_path, tokenizer):
    rows = [
        {"prompt": "Q: ", "chosen": "yes", "rejected": "no"},
        {"chosen": "only", "rejected": "pair"},
        {
            "prompt": [{"role": "user", "content": "hi"}],
            "chosen": [{"role": "assistant", "content": "hello"}],
            "rejected": [{"role": "assistant", "content": "go away"}],
        },
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, second, chat = load_preference_pairs(str(path))
    assert pair_texts(first, tokenizer) == ("Q: yes", "Q: no") and pair_texts(second, tokenizer) == ("only", "pair")
    chosen, rejected = pair_texts(chat, tokenizer)
    assert chosen == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    assert rejected.endswith("<|im_start|>assistant\ngo away<|im_end|>\n")
    implicit = PreferencePair(chosen=chat.prompt + chat.chosen, rejected=chat.prompt + chat.rejected)
    assert pair_texts(implicit, tokenizer) == (chosen, rejected)  # TRL's implicit prompt: the same texts


def test_a_datasets_folder(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"chosen": ["a", "b"], "rejected": ["c", "d"]}).save_to_disk(str(tmp_path / "ds"))
    assert load_preference_pairs(str(tmp_path / "ds")) == [PreferencePair("a", "c"), PreferencePair("b", "d")]
    with_margin = datasets.Dataset.from_dict({"chosen": ["a"], "rejected": ["c"], "margin": [1.5]})
    assert load_preference_pairs(with_margin) == [PreferencePair("a", "c", margin=1.5)]  # TRL's margin column


@pytest.mark.parametrize(
    "row, message",
    [
        ({"chosen": "a", "rejceted": "b"}, r"row 1: has no field `rejected` \(it has `chosen`, `rejceted`\)"),
        ({"chosen": "", "rejected": "b"}, r"row 1: `chosen` must be a non-empty text or a list of chat messages"),
        ({"chosen": [{"role": "assistant", "content": "x"}], "rejected": "b"}, "both be text or both chat"),
        ({"chosen": "a", "rejected": "b", "margin": "big"}, r"row 1: `margin` must be a finite number .*'big'"),
        ({"chosen": "a", "rejected": "b", "margin": True}, r"row 1: `margin` must be a finite number"),
    ],
)
def test_bad_rows_are_one_error_naming_the_row_and_field(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=message):
        load_preference_pairs(str(path))


def test_sources_that_are_not_there_or_not_known():
    with pytest.raises(DataError, match="`builtin:nope`: the built-in sets are polarity"):
        load_preference_pairs("builtin:nope")
    with pytest.raises(DataError, match="does not exist"):
        load_preference_pairs("no/such/file.jsonl")
