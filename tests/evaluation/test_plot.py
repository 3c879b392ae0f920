"""lmppo.evaluation.plot: curves from metrics.jsonl files into a PNG."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("matplotlib", reason="plotting needs matplotlib")

from lmppo.errors import LmppoError
from lmppo.evaluation.plot import plot_runs, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(folder, n=6, scale=1.0, extra_lines=()):
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as fh:
        for i in range(n):
            row = {
                "episode": (i + 1) * 16,
                "objective/scores": scale * math.tanh(i / 3),
                "objective/kl": 0.5 * i,
                "objective/rlhf_reward": scale * math.tanh(i / 3) - 0.025 * i,
                "policy/clipfrac_avg": 0.1,
                "loss/value_avg": 1.0 / (i + 1),
                "response/length_mean": 20 - i,
                "objective/entropy": float("nan") if i == 2 else 30.0,
            }
            fh.write(json.dumps(row) + "\n")
        for line in extra_lines:
            fh.write(line + "\n")
    return folder


def test_one_run_makes_a_png(tmp_path):
    run = _write_run(tmp_path / "run_a")
    out = plot_runs([str(run)], str(tmp_path / "plots" / "curves.png"))
    data = open(out, "rb").read()
    assert out.endswith("curves.png") and data[:8] == PNG_MAGIC and len(data) > 5000


def test_two_runs_overlay_and_bad_lines_are_counted(tmp_path):
    a = _write_run(tmp_path / "run_a")
    b = _write_run(tmp_path / "run_b", n=4, scale=0.5, extra_lines=['{"episode": 80, "objective/sc', "[1, 2]"])
    rows, bad = read_metrics(str(b))
    assert (len(rows), bad) == (4, 2)
    with pytest.warns(UserWarning, match="skipped 2 malformed"):
        out = plot_runs([str(a), str(b)], str(tmp_path / "both.png"))
    assert open(out, "rb").read()[:8] == PNG_MAGIC


def test_missing_or_empty_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(LmppoError, match="no metrics file"):
        plot_runs([str(tmp_path / "nowhere")], str(tmp_path / "x.png"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("\n")
    with pytest.raises(LmppoError, match="holds no metrics"):
        plot_runs([str(tmp_path / "empty")], str(tmp_path / "x.png"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metrics.jsonl").write_text('{"episode": 1, "something/else": 3}\n')
    with pytest.raises(LmppoError, match="none of the metrics"):
        plot_runs([str(tmp_path / "other")], str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


def test_ema_is_debiased_at_the_start():
    from lmppo.evaluation.plot import ema

    assert ema([1.0, 0.0], 0.5) == pytest.approx([1.0, 0.25 / 0.75])  # s1 = .5, s2 = .25; / (1 - .5^t)
    assert ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # a constant stays constant


def test_every_reward_source_gets_a_panel_with_judges_after_the_trained_ones(tmp_path):
    from lmppo.evaluation.plot import panels

    run = _write_run(tmp_path / "run", n=12)
    rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
    with open(run / "metrics.jsonl", "w") as fh:
        for r in rows:
            fh.write(
                json.dumps(
                    {
                        **r,
                        "reward/a_judge": 0.1,
                        "reward/vader": 0.5,
                        "reward/num_invalid": 0,
                        "objective/kl_coef": 0.05,
                    }
                )
                + "\n"
            )
    (run / "config.yaml").write_text(
        "reward:\n  sources:\n    - {name: vader, weight: 1.0}\n    - {name: a_judge, weight: 0.0}\n"
    )
    got = panels([str(run)])
    keys = [k for k, _ in got]
    assert keys[:3] == ["objective/scores", "reward/vader", "reward/a_judge"]  # the judge after, though sorted first
    assert "reward/num_invalid" not in keys and "objective/kl_coef" in keys
    assert dict(got)["reward/a_judge"].endswith("(weight 0: judge)")
    (run / "summary.json").write_text(
        json.dumps(
            {
                "before": {"score": 0.1, "reward/a_judge": 0.0, "kl": 0.0},
                "after": {"score": 0.6, "reward/a_judge": 0.2, "kl": 4.0},
            }
        )
    )
    out = plot_runs([str(run)], str(tmp_path / "c.png"))  # 12 points: raw + smoothed lines, held-out crosses
    assert open(out, "rb").read()[:8] == PNG_MAGIC


def test_a_reward_panel_that_repeats_the_score_is_left_out(tmp_path):
    from lmppo.evaluation.plot import panels

    run = _write_run(tmp_path / "run")
    rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
    with open(run / "metrics.jsonl", "w") as fh:
        for r in rows:  # one unweighted source: reward/vader == objective/scores in every row
            fh.write(json.dumps({**r, "reward/vader": r["objective/scores"], "reward/judge": 0.3}) + "\n")
    keys = [k for k, _ in panels([str(run)])]
    assert "reward/vader" not in keys and "reward/judge" in keys


def test_the_kl_target_is_drawn_beside_the_kl(tmp_path, monkeypatch):
    """`objective/kl_target` (a controller's kl.target) as a dotted step line on the `objective/kl` panel."""
    from matplotlib.axes import Axes

    from lmppo.evaluation.plot import beside_series

    run = _write_run(tmp_path / "run", extra_lines=[json.dumps({"episode": 112, "objective/kl": 2.0})])
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    for i, row in enumerate(rows):
        if i < 6:
            row["objective/kl_target"] = 4.0 if i < 3 else 2.0  # a resumed run's new target from iteration 4
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert beside_series("objective/kl", rows) == ([16.0, 32.0, 48.0, 64.0, 80.0, 96.0], [4.0] * 3 + [2.0] * 3)
    assert beside_series("objective/scores", rows) == ([], [])
    drawn = []
    original = Axes.plot

    def recording(self, *args, **kwargs):
        drawn.append((self.get_title(), list(args[1]) if len(args) > 1 else None, kwargs.get("linestyle")))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", recording)
    plot_runs([str(run)], str(tmp_path / "curves.png"))
    dotted = [ys for _title, ys, style in drawn if style == ":"]
    assert dotted == [[4.0] * 3 + [2.0] * 3]  # once, in the KL panel only
