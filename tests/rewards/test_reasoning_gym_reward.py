"""The reward `lmppo.rewards.builtin:reasoning_gym`: each completion scored by its task's own `score_answer`,
called by keyword with the rows' `entry` and `task` columns (hand-worked values)."""

from __future__ import annotations

import pytest

from lmppo.config import RewardSourceConfig
from lmppo.data.generated import reasoning_gym_records
from lmppo.rewards.builtin import reasoning_gym
from lmppo.rewards.functions import FunctionSource
from lmppo.rewards.sources import SourceContext

pytest.importorskip("reasoning_gym")

ENTRY = {"question": "Calculate 5 - 3 - 6.", "answer": "-4", "metadata": {"source_dataset": "basic_arithmetic"}}


def test_hand_worked_scores_of_basic_arithmetic():
    completions = ["-4", " -4\n", "<answer>-4</answer>", "-5", "x = -4", "<answer>4</answer> so -4"]
    # exact: 1; a wrong number: 0; the answer inside longer text: basic_arithmetic's partial credit
    # len("-4") / len("x = -4") = 2 / 6; the tagged answer wins over the rest of the text: "4" is not "-4"
    assert reasoning_gym(completions, [ENTRY] * 6) == pytest.approx([1.0, 1.0, 1.0, 0.0, 2 / 6, 0.0])


def test_the_task_column_rebuilds_the_task_with_the_runs_options():
    # decimal_arithmetic accepts an answer within 10^-max_num_decimal_places of its own: 1.55 against 1.5 is within
    # 0.1 (1 place, the run's option) but not within 0.001 (3 places, the task's default)
    entry = {"question": "Calculate 1.2 + 0.3.", "answer": "1.5", "metadata": {"source_dataset": "decimal_arithmetic"}}
    one_place = {"name": "decimal_arithmetic", "options": {"min_num_decimal_places": 1, "max_num_decimal_places": 1}}
    assert reasoning_gym(["1.55", "1.7"], [entry] * 2, [one_place] * 2) == [1.0, 0.0]
    assert reasoning_gym(["1.55"], [entry]) == [0.0]  # no `task` column: the entry's task with its defaults


def test_called_by_keyword_from_the_prompt_rows_columns():
    rows = reasoning_gym_records("basic_arithmetic", 3, 0, {"max_terms": 2, "max_digits": 1})
    source = FunctionSource(
        RewardSourceConfig(kind="function", path="lmppo.rewards.builtin:reasoning_gym"), SourceContext()
    )
    source.check_arguments(["answer", "entry", "task"])
    completions = [rows[0]["answer"], "no idea", rows[2]["answer"]]
    columns = [{k: v for k, v in r.items() if k != "prompt"} for r in rows]
    assert source([r["prompt"] for r in rows], completions, None, columns) == [1.0, 0.0, 1.0]
