"""Sampling that continues: the native engine's turns from one KV cache kept across the episode give exactly the
tokens of sampling each turn afresh from the whole history (ids, never text), and the first turn is the single-turn
response."""

from __future__ import annotations

import torch

from conftest import tiny_llama
from lmppo.sampling.hf import left_pad
from lmppo.sampling.native import sample_native
from lmppo.sampling.turns import CachedTurns, RepeatedPrefill, turn_seeds

STOP = 4  # a token id of the tiny vocabulary used as the stop token (sampled now and then by the random model)


def _prefill_sampler(model, pad_id, max_new):
    def sample(histories, seeds):
        ids, mask = left_pad(histories, pad_id)
        return sample_native(model, ids, mask, 1.0, max_new, torch.tensor([STOP]), pad_id, seeds, decoding="dynamic")

    return RepeatedPrefill(sample)


def test_cached_turns_equal_sampling_each_turn_from_the_whole_history(tokenizer):
    model = tiny_llama(tokenizer, seed=3)
    pad = tokenizer.pad_token_id
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    seeds = [11, 22, 33]
    cached = CachedTurns(model, 1.0, 6, torch.tensor([STOP]), pad)
    fresh = _prefill_sampler(model, pad, 6)
    first = cached.first(prompts, seeds)
    assert first == fresh.first(prompts, seeds)
    ids, mask = left_pad(prompts, pad)
    single = sample_native(model, ids, mask, 1.0, 6, torch.tensor([STOP]), pad, seeds, decoding="dynamic")
    assert first == [row[m].tolist() for row, m in zip(single[0], single[1])]
    # observations of different lengths; the second episode ends after turn 1, the third after turn 2
    turns = [first]
    for turn, observations in enumerate([[[20, 21], None, [22, 23, 24, 25]], [[26], None, None]], start=1):
        got = cached.next(observations, turn)
        assert got == fresh.next(observations, turn), turn
        assert [bool(t) for t in got] == [o is not None for o in observations]
        turns.append(got)
    assert all(len(t) <= 6 for turn in turns for t in turn)
    # the cache holds each row's real tokens, nothing else: prompt + turns + observations (the last token pending)
    lengths = [len(p) for p in prompts]
    lengths[0] += len(turns[0][0]) + 2 + len(turns[1][0]) + 1 + len(turns[2][0]) - 1
    lengths[1] += len(turns[0][1]) - 1
    lengths[2] += len(turns[0][2]) + 4 + len(turns[1][2]) - 1
    assert cached.attention.sum(1).tolist() == lengths


def test_turn_seeds_keep_the_first_turn_and_differ_after():
    assert turn_seeds([1, 2], 0) == [1, 2]
    later = turn_seeds([1, 2], 1)
    assert later != [1, 2] and later != turn_seeds([1, 2], 2) and len(set(later)) == 2
