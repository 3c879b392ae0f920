"""What an evaluation prints (lmppo.evaluation.tables): the console's width when piped, the sample table."""

import io

from rich.console import Console

from lmppo.evaluation.tables import PIPED_WIDTH, ComparedPrompt, make_console, sample_comparison


def test_piped_output_is_not_cut_at_80_columns(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    console = make_console()  # pytest captures stdout: not a terminal
    assert not console.is_terminal and console.width == PIPED_WIDTH
    monkeypatch.setenv("COLUMNS", "97")
    assert make_console().width == 97  # the user's setting wins


def test_a_summary_line_stays_on_one_line_when_piped(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    console = make_console()
    out = io.StringIO()
    console.file = out
    line = "iter 12/12 episode 384  score +0.512  kl 3.21  beta 0.0184  len 23.5  3.51 eps  ~0:00 left  rlhf +0.48"
    console.print(line)
    assert out.getvalue() == line + "\n"


def test_sample_table_shows_prompts_and_scored_responses():
    out = io.StringIO()
    Console(file=out, width=120).print(
        sample_comparison(
            [ComparedPrompt("The movie was", " fine.", " great!", after_scores={"vader": 0.66})],
            "start",
            "trained",
        )
    )
    text = out.getvalue()
    assert "The movie was" in text and "great!" in text and "vader +0.66" in text and "<|im_start|>" not in text
