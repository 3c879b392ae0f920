"""Token character offsets and placing reward outputs on tokens (lmppo.rewards.placement).

The tokenizer is a byte-level BPE where tokens and characters do not align: " was great!" is
['Ġwas', 'Ġgreat', '!'] and " 猫 sat" is ['Ġ', 'ç', 'Į', '«', 'Ġs', 'a', 't'] (猫 is three byte tokens).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers_tokenizers import make_bpe_tokenizer, make_wordpiece_tokenizer
from lmppo.rewards.placement import decode_completion, parse_output, place_scores, token_char_offsets

T = 9


@pytest.fixture(scope="module")
def tok():
    return make_bpe_tokenizer()


@pytest.fixture(scope="module")
def batch(tok):
    """Three responses: two end with EOS (the stop token), the third was truncated (no stop token)."""
    eos, pad = tok.eos_token_id, tok.pad_token_id
    texts = [" was great!", " 猫 sat", "Bad movie"]
    rows = [tok(texts[0])["input_ids"] + [eos], tok(texts[1])["input_ids"] + [eos], tok(texts[2])["input_ids"]]
    assert [len(r) for r in rows] == [4, 8, 3]
    ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows])
    mask = torch.tensor([[j < len(r) for j in range(T)] for r in rows])
    offsets = [token_char_offsets(tok, r, text=t) for r, t in zip(rows, texts)]
    return texts, rows, ids, mask, offsets


def test_offsets_by_hand(batch):
    texts, rows, _, _, offsets = batch
    assert offsets[0] == [(0, 4), (4, 10), (10, 11), (11, 11)]  # " was", " great", "!", EOS at the end
    # the three byte tokens of 猫 all cover it; the stop token's range is empty at the end
    assert offsets[1] == [(0, 1), (1, 2), (1, 2), (1, 2), (2, 4), (4, 5), (5, 6), (6, 6)]
    assert offsets[2] == [(0, 1), (1, 3), (3, 9)]  # "B", "ad", " movie": no stop token, nothing left out


def test_stop_token_inferred_or_given(tok):
    ids = tok(" was great!")["input_ids"] + [tok.eos_token_id]
    # EOS is skipped in decoding, so with or without has_stop it gets the empty range at the end
    assert token_char_offsets(tok, ids) == token_char_offsets(tok, ids, has_stop=True)
    # a literal stop token that is ordinary text ("!") is excluded from the text only when it is the stop token
    bang = tok(" was great!")["input_ids"]
    assert token_char_offsets(tok, bang, text=" was great") == [(0, 4), (4, 10), (10, 10)]
    assert token_char_offsets(tok, bang, text=" was great!") == [(0, 4), (4, 10), (10, 11)]
    with pytest.raises(ValueError, match="is not the decoding of its tokens"):
        token_char_offsets(tok, bang, text="something else")


def test_partial_character_at_the_end_of_a_truncated_response(tok):
    ids = tok(" 猫")["input_ids"][:3]  # 'Ġ', and two of the three bytes of 猫
    text = decode_completion(tok, ids)
    assert text == " \ufffd"
    assert token_char_offsets(tok, ids, text=text) == [(0, 1), (1, 2), (2, 2)]


def test_scalar_lands_on_the_last_real_token(batch):
    *_, mask, _ = batch
    scores = place_scores([1.5, -2, 0.25], mask)
    expected = torch.zeros(3, T)
    expected[0, 3] = 1.5  # the stop token
    expected[1, 7] = -2.0  # the stop token
    expected[2, 2] = 0.25  # truncated: its last token " movie"
    assert torch.equal(scores, expected)


def test_per_token_list(batch):
    *_, mask, _ = batch
    scores = place_scores([[0.1, 0.2, 0.3, 0.4], list(range(8)), torch.tensor([1.0, 2.0, 3.0])], mask)
    expected = torch.zeros(3, T)
    expected[0, :4] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    expected[1, :8] = torch.arange(8.0)
    expected[2, :3] = torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(scores, expected)


def test_spans_last(batch):
    *_, mask, offsets = batch
    outputs = [
        [(5, 10, 2.0), (0, 11, 1.0)],  # "great" -> token 1 " great"; the whole text -> its last token "!"
        # 猫 -> its last byte token 3; "s" -> token 4 " s"; an empty span at the end -> the EOS
        [(1, 2, 3.0), (3, 4, -1.0), (6, 6, 0.5)],
        [(1, 2, 4.0), (0, 9, 1.0)],  # "a" of "Bad" -> token 1 "ad"; everything -> token 2 " movie"
    ]
    scores = place_scores(outputs, mask, offsets, span_placement="last")
    expected = torch.zeros(3, T)
    expected[0, 1], expected[0, 2] = 2.0, 1.0
    expected[1, 3], expected[1, 4], expected[1, 7] = 3.0, -1.0, 0.5
    expected[2, 1], expected[2, 2] = 4.0, 1.0
    assert torch.equal(scores, expected)


def test_spans_spread(batch):
    *_, mask, offsets = batch
    outputs = [
        [(0, 11, 3.0)],  # " was great!" -> 1.0 on each of its 3 tokens (not on EOS)
        [(1, 2, 3.0), (2, 6, -3.0)],  # 猫 -> 1.0 on each byte token; " sat" -> -1.0 on " s", "a", "t"
        [],  # no spans: nothing
    ]
    scores = place_scores(outputs, mask, offsets, span_placement="spread")
    expected = torch.zeros(3, T)
    expected[0, :3] = 1.0
    expected[1, 1:4] = 1.0
    expected[1, 4:7] = -1.0
    assert torch.allclose(scores, expected)


def test_mixed_forms_in_one_batch(batch):
    *_, mask, offsets = batch
    scores = place_scores([2.0, [(2, 4, 1.0)], [0.0, 1.0, 0.0]], mask, offsets)
    expected = torch.zeros(3, T)
    expected[0, 3] = 2.0
    expected[1, 4] = 1.0
    expected[2, 1] = 1.0
    assert torch.equal(scores, expected)


def test_masked_positions_stay_zero_whatever_the_padding_ids(batch, tok):
    *_, mask, offsets = batch
    outputs = [1.0, [(0, 6, 6.0)], [1.0, 1.0, 1.0]]
    scores = place_scores(outputs, mask, offsets, span_placement="spread")
    assert torch.all(scores[~mask] == 0)
    # the sum of a spread span is the span's value
    assert scores[1].sum().item() == pytest.approx(6.0)


@pytest.mark.parametrize(
    "out,match",
    [
        (float("nan"), "not finite"),
        (float("inf"), "not finite"),
        ("0.5", "expected a number, a list of numbers"),
        (None, "expected a number"),
        ([1.0, 2.0], "per-token scores have length 2, the response has 4 tokens"),
        ([1.0, float("nan"), 0.0, 0.0], r"per-token score \[1\] is nan"),
        ([(0, 12, 1.0)], r"span \[0\] \(0, 12, 1.0\) is outside the text: need 0 <= start <= end <= 11"),
        ([(5, 3, 1.0)], r"span \[0\] \(5, 3, 1.0\) is outside the text"),
        ([(-1, 3, 1.0)], "is outside the text"),
        ([(0.5, 3, 1.0)], "start_char 0.5 is not an integer"),
        ([(0, 3, "x")], r"span \[0\] value is 'x'"),
        ([(0, 3)], r"item \[0\] is \(0, 3\)"),
        ([1.0, (0, 3, 1.0)], r"item \[0\] is 1.0; a list must hold only numbers"),
    ],
)
def test_bad_outputs(out, match):
    with pytest.raises(ValueError, match=match):
        parse_output(out, num_tokens=4, text_len=11)


def test_place_scores_names_the_sample(batch):
    *_, mask, offsets = batch
    with pytest.raises(ValueError, match=r"sample 1: per-token scores have length 2"):
        place_scores([1.0, [1.0, 2.0], 1.0], mask, offsets)


def naive_offsets(tokenizer, ids):
    """Token k covers decode(ids[:k+1])[len(decode(ids[:k])):] (true when prefixes only ever grow)."""
    out, prev = [], ""
    for k in range(len(ids)):
        cur = decode_completion(tokenizer, ids[: k + 1])
        assert cur.startswith(prev)
        out.append((len(prev), len(cur)))
        prev = cur
    return out


def test_matches_the_naive_definition_on_ascii(tok):
    ids = tok(" The movie was great and I loved it. Hello, world!")["input_ids"]
    assert token_char_offsets(tok, ids) == naive_offsets(tok, ids)


def test_wordpiece_decoder_with_space_cleanup():
    wp = make_wordpiece_tokenizer()
    ids = wp("the movie . was wonderfully strange .", add_special_tokens=False)["input_ids"]
    pieces = wp.convert_ids_to_tokens(ids)
    assert any(p.startswith("##") for p in pieces)
    text = decode_completion(wp, ids)
    assert text == "the movie. was wonderfully strange."  # the decoder removes the space before "."
    offsets = token_char_offsets(wp, ids, text=text)
    assert len(offsets) == len(ids)
    for (a, b), piece in zip(offsets, pieces):  # each token's range holds its piece (plus a leading space)
        assert text[a:b].lstrip() == piece.removeprefix("##")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=5, max_value=399), min_size=1, max_size=12))
def test_offsets_tile_the_text(ids):
    tok = make_bpe_tokenizer()
    text = decode_completion(tok, ids)
    offsets = token_char_offsets(tok, ids, text=text)
    assert len(offsets) == len(ids)
    starts = [a for a, _ in offsets]
    assert starts == sorted(starts) and starts[0] == 0
    assert all(0 <= a <= b <= len(text) for a, b in offsets)
    covered = set()
    for a, b in offsets:
        covered.update(range(a, b))
    assert covered == set(range(len(text)))  # every character belongs to some token
