"""The llama.cpp sampling anchor's batch layouts and weight bytes (benchmarks/speed/llama_anchor.py, standard library
only: no llama_cpp needed here; timing is the benchmark's job, not a test's)."""

import os
import sys

from conftest import REPO  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "benchmarks", "shared"))
import bench_path  # noqa: E402, F401  (every benchmark folder on the path)
from llama_anchor import prefill_layout, step_layout, step_weight_bytes


def test_prefill_puts_each_prompt_in_its_own_sequence_with_logits_at_its_last_token():
    rows, logit_rows = prefill_layout([[5, 6, 7], [8], [9, 10]])
    assert rows == [
        (5, 0, 0, False),
        (6, 1, 0, False),
        (7, 2, 0, True),
        (8, 0, 1, True),
        (9, 0, 2, False),
        (10, 1, 2, True),
    ]
    assert logit_rows == [2, 3, 5]


def test_decoding_steps_continue_each_sequence_after_its_own_prompt():
    prompts = [[5, 6, 7], [8], [9, 10]]
    assert step_layout(prompts, [11, 12, 13], 1) == [(11, 3, 0, True), (12, 1, 1, True), (13, 2, 2, True)]
    assert step_layout(prompts, [14, 15, 16], 4) == [(14, 6, 0, True), (15, 4, 1, True), (16, 5, 2, True)]


def test_a_step_reads_a_tied_embedding_whole_and_skips_an_untied_one():
    trunk = [("blk.0.attn_q.weight", 100), ("blk.0.ffn_up.weight", 300), ("output_norm.weight", 4)]
    assert step_weight_bytes(trunk + [("token_embd.weight", 1000)]) == 1404  # tied: the LM head
    assert step_weight_bytes(trunk + [("token_embd.weight", 1000), ("output.weight", 900)]) == 1304
