"""The learned-reward benchmark's frontier arithmetic (benchmarks/learning/learned_reward.py), on hand-worked points: a
curve read linearly in sqrt(KL), replicate families averaged per prompt, TRL's best trajectory kept, and the
paired table's mean and noise. Nothing here trains or times anything."""

import json
import shutil
import sys
from pathlib import Path

import pytest

from conftest import REPO  # noqa: E402

sys.path.insert(0, str(Path(REPO) / "benchmarks" / "shared"))
import bench_path  # noqa: E402, F401  (every benchmark folder on the path)
import learned_reward as lr  # noqa: E402


def _p(name, side, kl, a, b):
    """A judged point with two held-out prompts scoring a and b (start: 0 and 0)."""
    return {
        "name": name,
        "side": side,
        "kl": kl,
        "by_prompt": {"x": a, "y": b},
        "start_by_prompt": {"x": 0.0, "y": 0.0},
    }


def test_a_curve_is_linear_in_sqrt_kl_between_its_points():
    pts = [(0.0, {"x": 0.0}), (4.0, {"x": 1.0}), (16.0, {"x": 3.0})]
    assert lr._curve_at(pts, 1.0)["x"] == pytest.approx(0.5)  # sqrt 1 = half way to sqrt 4
    assert lr._curve_at(pts, 9.0)["x"] == pytest.approx(2.0)  # sqrt 9 = 3: half way from 2 to 4
    assert lr._curve_at(pts, 17.0) is None


def test_families_are_replicates_averaged_per_prompt_and_trl_keeps_its_best_run():
    points = [
        _p("lmppo-a-b4-s0", "lmppo-merge", 4.0, 1.0, 2.0),
        _p("lmppo-b-b4-s0", "lmppo-merge", 4.0, 3.0, 0.0),
        _p("lmppo-a-b4-s1", "lmppo-merge", 4.0, 9.0, 9.0),  # another seed: not in seed 0's curve
        _p("trl-lr1-s0/eval-iter-002", "trl", 4.0, 0.5, 0.5),
        _p("trl-lr2-s0/eval-iter-002", "trl", 4.0, 1.0, 0.0),
        _p("trl-lr2-early-s0/eval-iter-001", "trl", 1.0, 0.4, 0.4),
    ]
    start = (0.0, {"x": 0.0, "y": 0.0})
    lm, trl = lr._both_at(points, start, 0, 4.0, ("lmppo-a-", "lmppo-b-"))
    assert lm == {"x": 2.0, "y": 1.0}  # the mean of the two families at KL 4
    assert trl == {"x": 0.5, "y": 0.5}  # both TRL runs sum to 1 there; the first is kept on a tie
    lm, trl = lr._both_at(points, start, 0, 1.0, ("lmppo-a-",))
    assert lm == {"x": 0.5, "y": 1.0}  # half way (in sqrt KL) from the start to KL 4
    # the -early run joins lr2's trajectory: 0.4 at KL 1 beats lr1's line from the start (0.25)
    assert trl == {"x": pytest.approx(0.4), "y": pytest.approx(0.4)}
    assert lr._family("lmppo-kb-b2-s0", ("lmppo-", "lmppo-kb-")) == "lmppo-kb-"


def test_the_paired_table_takes_the_mean_difference_and_the_larger_noise():
    points = [
        _p("lmppo-a-b4-s0", "lmppo-merge", 4.0, 1.0, 1.0),
        _p("trl-s0/eval-iter-002", "trl", 4.0, 0.0, 0.0),
        _p("lmppo-a-b4-s1", "lmppo-merge", 4.0, 3.0, 3.0),
        _p("trl-s1/eval-iter-002", "trl", 4.0, 0.0, 0.0),
    ]
    [row] = [line for line in lr.frontier_table(points, kls=(4.0,), families=("lmppo-a-",)) if line.startswith("| 4 ")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:3] == ["1.00 / 0.00", "3.00 / 0.00"]
    assert cells[3] == "+2.000 (2 seeds)"
    # per-seed differences 1 and 3: SE over seeds = sd 1.414 / sqrt 2 = 1.000, above the prompts' bootstrap SE
    assert cells[4] == "1.000" and cells[5] == "no"
    assert cells[6] == "2 of 2"
    assert cells[7] == "2.00 (12.71, 1 df): no"  # t = 2 / 1 with one degree of freedom


def test_the_t_test_over_seeds_on_hand_worked_differences():
    # differences 1..5: mean 3, sample sd sqrt(2.5) = 1.581, SE 0.7071, t = 4.243 > 2.78 (4 df)
    assert lr._se_of_mean([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2.5**0.5 / 5**0.5)
    assert lr._t_test([1.0, 2.0, 3.0, 4.0, 5.0]) == "4.24 (2.78, 4 df): yes"
    # -1, 1, 3: mean 1, sd 2, SE 1.155, t = 0.87 < 4.30 (2 df)
    assert lr._t_test([-1.0, 1.0, 3.0]) == "0.87 (4.30, 2 df): no"
    assert lr._t_test([1.0]) == "-"  # one seed: no test
    # 41 seeds, differences alternating 0 and 2 (mean 21/41 * 2 = 1.0244): above 30 df the 30-df value is used
    assert lr._t_test([2.0 * (i % 2 == 0) for i in range(41)]).endswith("(2.04, 40 df): yes")


def _judged_run(folder, trained, start, kl):
    """A run folder as `judge` leaves it: result.json and eval.json with two held-out prompts, two samples each."""
    folder.mkdir(parents=True)
    result = {"side": "lmppo", "settings": {}, "heldout": {"trained": {"kl": kl, "reward/rm": sum(trained) / 4}}}
    (folder / "result.json").write_text(json.dumps(result))
    samples = [
        {"prompt": p, "trained_scores": {"rm": t}, "start_scores": {"rm": s}, "trained": "...", "start": "..."}
        for p, t, s in zip("xxyy", trained, start)
    ]
    (folder / "eval.json").write_text(json.dumps({"win_rate": 0.5, "samples": samples}))


def test_a_run_whose_cache_is_gone_is_read_back_from_its_compact_record(tmp_path, monkeypatch):
    monkeypatch.setattr(lr, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(lr, "RECORDS", tmp_path / "results" / "learned_reward.jsonl")
    _judged_run(tmp_path / "runs" / "trl-s0" / "eval-iter-002", [1.0, 3.0, 0.0, 0.5], [0.0, 1.0, 0.5, 0.5], 2.0)
    _judged_run(tmp_path / "runs" / "lmppo-a-s0", [2.0, 2.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0], 4.0)
    for run in ("trl-s0/eval-iter-002", "lmppo-a-s0"):
        lr.record(tmp_path / "runs" / run)
    from_cache = lr.collect()
    assert [p["name"] for p in from_cache] == ["lmppo-a-s0", "trl-s0/eval-iter-002"]  # whole runs first
    assert from_cache[1]["by_prompt"] == {"x": 2.0, "y": 0.25}  # the mean of each prompt's two samples
    assert from_cache[1]["start_by_prompt"] == {"x": 0.5, "y": 0.5}
    lines = lr.RECORDS.read_text().splitlines()
    assert [json.loads(line)["name"] for line in lines] == ["lmppo-a-s0", "trl-s0/eval-iter-002"]
    assert all("samples" not in json.loads(line)["eval"] for line in lines)  # the bulky raw samples stay out
    shutil.rmtree(tmp_path / "runs")
    assert lr.collect() == from_cache  # the same points, from the records alone
