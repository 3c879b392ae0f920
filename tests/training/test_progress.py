"""Training progress (lmppo.training.progress): one plain line per iteration when the console is not a terminal."""

import io

from rich.console import Console

from lmppo.training.progress import ProgressDisplay

METRICS = {
    "objective/scores": 0.5,
    "objective/kl": 3.25,
    "objective/kl_coef": 0.0184,
    "response/length_mean": 23.5,
    "eps": 3.5,
    "objective/rlhf_reward": 0.48,
    "val/ratio": 1.002,
}


def test_a_log_file_gets_one_whole_line_per_iteration():
    out = io.StringIO()
    console = Console(file=out, width=60, highlight=False)  # narrower than the line: it must not wrap
    display = ProgressDisplay()
    display.show(console, live=True, iteration=0, total=4, episode=0, train_seconds=0.0, m=None)
    display.show(console, live=True, iteration=2, total=4, episode=64, train_seconds=30.0, m=METRICS)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("iter 2/4 episode 64  score +0.500  kl 3.25  beta 0.0184  len 23.5  3.50 eps")
    assert "~0:30 left" in lines[0] and "ratio 1.002" in lines[0]  # 15 s per iteration, two to go


def test_the_beta_shown_is_the_controllers_wherever_the_kl_acts():
    # kl.placement: loss (or kl.estimator: exact): the rewards carry no penalty (objective/kl_coef 0), the loss's
    # term carries the controller's beta; the line showed "beta 0.0000" for such a whole run
    out = io.StringIO()
    in_loss = {**METRICS, "objective/kl_coef": 0.0, "loss/kl_coef": 0.0304}
    ProgressDisplay().show(Console(file=out, width=200), live=True, iteration=1, total=2, episode=32,
                           train_seconds=1.0, m=in_loss)  # fmt: skip
    assert "kl 3.25  beta 0.0304  len" in out.getvalue()


def test_the_python_api_gets_a_bar_and_log_progress_false_hides_it(capsys, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    display = ProgressDisplay()
    for iteration, m in ((0, None), (1, METRICS), (2, METRICS)):
        display.show(None, live=True, iteration=iteration, total=2, episode=0, train_seconds=30.0, m=m)
    err = capsys.readouterr().err
    assert "PPO: 100%" in err and "2/2" in err and "score +0.500  kl 3.25" in err
    assert display.tqdm_bar is None  # closed at the last iteration
    ProgressDisplay().show(None, live=False, iteration=1, total=1, episode=1, train_seconds=1.0, m=METRICS)
    assert capsys.readouterr().err == ""
