"""2 CPU processes (torchrun, gloo) against 1 process with the same global batch and seed.

The native sampler draws each response from its own stream seeded by (seed, iteration, global position), so
both layouts sample the same responses; with one minibatch per epoch the gradient is the token mean over the
same global batch, so the updates agree too. Tolerance: 1e-4 absolute (1e-4 relative for large values). The
only differences are float reduction order (DDP's all-reduce average vs one process's accumulation), seen at
about 1e-6. Excluded: wall-clock fields, and `val/ratio_var`, by definition a variance across each process's
micro-batch means.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import TESTS  # noqa: E402

pytestmark = pytest.mark.slow  # real processes, each training a model: minutes in all (make test-fast skips them)

HERE = TESTS
SKIP = {"eps", "tokens_per_s", "val/ratio_var"}


def run_workers(tmp_path, nproc: int, **env) -> list[dict]:
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found next to the Python interpreter")
    out = tmp_path / f"n{nproc}" / "metrics.json"
    out.parent.mkdir(parents=True)
    environ = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        **env,
        "PYTHONPATH": os.pathsep.join([os.path.join(HERE, "..", "src"), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", str(nproc), os.path.join(HERE, "dist_worker.py"), str(out)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def assert_close(a: dict, b: dict, keys=None) -> None:
    for k in keys or a:
        if k in SKIP or k.startswith("time/"):
            continue
        assert abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(a[k])), (k, a[k], b[k])


@pytest.mark.parametrize("value_mode", ["shared", "critic"])
def test_two_processes_match_one(tmp_path, value_mode):
    one = run_workers(tmp_path, 1, VALUE_MODE=value_mode)
    two = run_workers(tmp_path, 2, VALUE_MODE=value_mode)
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        assert set(a) == set(b)
        assert_close(a, b)


def test_two_processes_reusing_the_rollout_forward_match_one(tmp_path):
    """Micro-batches of 4: each of the 2 processes holds its whole 4-row share of the minibatch in one micro-batch,
    so it reuses the rollout's forward pass through the DDP wrapper (`ppo.reuse_rollout_forward`); the 1-process run
    has two micro-batches and runs the plain path. The updates must still agree. The clip fractions count tokens
    on either side of a threshold, so float rounding can move one token across it: seen here, one value token of
    the 96 of iteration 2's two epochs (0.0104 against 0) while every loss agreed to 1e-6; they may differ by that."""
    one = run_workers(tmp_path, 1, VALUE_MODE="critic", MICRO_BATCH="4")
    two = run_workers(tmp_path, 2, VALUE_MODE="critic", MICRO_BATCH="4")
    assert len(one) == len(two) == 3
    fractions = ["policy/clipfrac_avg", "val/clipfrac_avg"]
    for a, b in zip(one, two):
        assert_close(a, b, [k for k in a if k not in fractions])
        one_token = 1.0 / (a["response/length_mean"] * 8 * 2)  # of the iteration's tokens over 2 epochs
        for k in fractions:
            assert abs(a[k] - b[k]) <= one_token * 1.01, (k, a[k], b[k])


def test_two_processes_sample_the_same_first_batch_with_minibatches(tmp_path):
    # with 2 minibatches the shuffle is per process, so updates differ; the first rollout does not
    one = run_workers(tmp_path, 1, NUM_MINIBATCHES="2")
    two = run_workers(tmp_path, 2, NUM_MINIBATCHES="2")
    assert_close(
        one[0],
        two[0],
        [
            "objective/scores",
            "objective/kl",
            "objective/entropy",
            "response/length_mean",
            "val/num_eos_tokens",
            "episode",
        ],
    )


def test_two_processes_retire_the_same_settled_prompts_as_one(tmp_path):
    """`data.retire_settled_after` 1 with grpo, 2 processes of 2 prompts each: every process draws the same global
    batches and retires the same prompts as one process does (the settled flags are summed over processes)."""
    run_workers(tmp_path, 1, RETIRE_SETTLED="1")
    run_workers(tmp_path, 2, RETIRE_SETTLED="1")
    one = json.loads((tmp_path / "n1" / "metrics.json.rank0.drawn.json").read_text())
    ranks = [json.loads((tmp_path / "n2" / f"metrics.json.rank{r}.drawn.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] == one
    assert one["retired"]  # the filter did retire prompts (the second half of PROMPTS x 2 always scores alike)
    drawn_after = [p for batch in one["batches"][4:] for p in batch]  # after the first pass over the 16 prompts
    assert not set(drawn_after) & set(one["retired"])


def test_two_processes_match_one_with_a_batch_scale_and_a_sequence_mean(tmp_path):
    """`ppo.grpo_scale: batch` divides by the std of every process's scores (`Strategy.gather_std`), and
    `ppo.loss_aggregation: sequence_mean` divides by the sequences of every process: 2 processes train as 1."""
    one = run_workers(tmp_path, 1, GRPO_BATCH_SCALE="1")
    two = run_workers(tmp_path, 2, GRPO_BATCH_SCALE="1")
    assert len(one) == len(two) == 3
    assert one[0]["policy/approxkl_avg"] > 0  # it did take steps
    for a, b in zip(one, two):
        assert set(a) == set(b)
        assert_close(a, b)


@pytest.mark.parametrize("value_mode", ["shared", "critic"])
def test_two_processes_match_one_with_an_environment(tmp_path, value_mode):
    """Multi-turn episodes (tests/countdown_env.py: a reward on every turn, episodes of 1 to 3 turns): each process
    plays its share of the global batch's episodes, seeded by their global positions, so 2 processes play the same
    episodes as 1 and train to the same weights (iterations 2 and 3 score, and measure their KL, alike); the per-turn
    credit (GAE over the policy's tokens) is the same.

    Not compared: the losses and the ratio, TRL's means of each micro-batch's token mean. Episodes of 1 to 3 turns
    put unequal token counts in the micro-batches, and 2 processes cut the batch into other micro-batches than 1
    does, so those means of means differ (seen: loss/policy_avg 0.034 against 0.004) while the loss trained on, the
    token mean over the minibatch, is the same. Single responses of equal length (the tests above) hide this."""
    one = run_workers(tmp_path, 1, VALUE_MODE=value_mode, ENVIRONMENT="1")
    two = run_workers(tmp_path, 2, VALUE_MODE=value_mode, ENVIRONMENT="1")
    assert len(one) == len(two) == 3
    assert one[0]["episode/turns"] > 1  # multi-turn episodes were played
    split_dependent = {"loss/policy_avg", "loss/value_avg", "val/ratio"}
    for a, b in zip(one, two):
        assert set(a) == set(b)
        assert_close(a, b, [k for k in a if k not in split_dependent])
    assert any(r["policy/approxkl_avg"] > 0 for r in one)  # it did take steps


def test_stop_called_on_the_main_process_alone_ends_every_process(tmp_path):
    """on_log runs on the main process only; a stop() there must end the run on both processes after the same
    iteration (without the agreement, process 1 would start iteration 2 and wait for process 0 until the timeout)."""
    two = run_workers(tmp_path, 2, STOP_AFTER="1")
    assert len(two) == 1 and two[0]["iteration"] == 1
