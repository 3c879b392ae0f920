"""The Rollout batch: joined prompt and response, lengths, and row selection, on a hand-made batch of three."""

import torch

from conftest import hand_rollout
from lmppo.training.batch import Rollout


def _rollout() -> Rollout:
    t = torch.tensor
    return hand_rollout(
        prompt_ids=t([[0, 5], [6, 7], [0, 8]]),
        prompt_mask=t([[False, True], [True, True], [False, True]]),
        response_ids=t([[1, 2, 0], [3, 0, 0], [4, 4, 4]]),
        response_mask=t([[True, True, False], [True, False, False], [True, True, True]]),
        logprobs=t([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0], [-0.5, -0.5, -0.5]]),
        ref_logprobs=torch.zeros(3, 3),
        values=torch.zeros(3, 3),
        final_values=t([0.25, 0.5, 0.75]),
        terminated=t([True, True, False]),
        truncated=t([False, False, True]),
        group_ids=t([0, 0, 1]),
        prompts_text=["a", "a", "b"],
        responses_text=["x", "y", "z"],
    )


def test_joined_ids_masks_and_lengths():
    r = _rollout()
    assert r.batch_size == 3
    assert r.input_ids.tolist()[1] == [6, 7, 3, 0, 0]
    assert r.attention_mask.tolist()[0] == [False, True, True, True, False]
    assert r.response_lengths.tolist() == [2, 1, 3]


def test_select_picks_rows_of_every_field():
    s = _rollout().select([2, 0])
    assert s.response_ids.tolist() == [[4, 4, 4], [1, 2, 0]]
    assert s.final_values.tolist() == [0.75, 0.25]
    assert (
        s.episodes.prompts.texts == ["b", "a"] and s.episodes.side.texts == ["z", "x"] and s.prompts_shown == ["b", "a"]
    )
    assert s.episodes.side.transcripts == [["z"], ["x"]] and s.episodes.side.stop_reasons == [
        "max_new_tokens",
        "stop_token",
    ]
    assert torch.equal(s.episodes.response_ids, s.response_ids) and s.episodes.prompts.batch.token_lists == [[8], [5]]
    assert s.entropy is None and s.episodes.prompts.columns is None  # absent fields stay absent
    r = _rollout().rows(1, 3)
    assert r.episodes.side.texts == ["y", "z"] and r.episodes.turns.turn_ends.tolist() == [[0], [2]]
    assert _rollout().select(torch.tensor([1])).terminated.tolist() == [True]
