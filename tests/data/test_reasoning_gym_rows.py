"""`data.prompts: reasoning_gym:TASK`: rows made by the real reasoning-gym library, a pure function of (task, seed,
size, options), sized and seeded from the run; a task or option reasoning-gym does not have is one error line."""

from __future__ import annotations

import pytest

from lmppo.config import Config, DataConfig
from lmppo.data.generated import LIST_TASKS, reasoning_gym_records
from lmppo.data.prompts import generated_size, load_prompt_records, run_prompt_records, split_holdout
from lmppo.errors import ConfigError

pytest.importorskip("reasoning_gym")  # the extra `environments` (installed by `make setup`, so CI runs these)

EASY = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "allow_parentheses": False}


def run_config(**fields) -> Config:
    cfg = Config()
    cfg.data = DataConfig(prompts="reasoning_gym:basic_arithmetic", task_options=dict(EASY))
    cfg.total_episodes, cfg.rollout.batch_size, cfg.rollout.num_samples_per_prompt = 512, 32, 8
    for name, value in fields.items():
        setattr(cfg.data, name, value)
    return cfg


def test_a_row_is_the_tasks_question_answer_and_entry():
    import reasoning_gym

    rows = reasoning_gym_records("basic_arithmetic", 5, 3, EASY)
    item = reasoning_gym.create_dataset("basic_arithmetic", size=5, seed=3, **EASY)[2]
    assert rows[2]["prompt"] == item["question"] and rows[2]["prompt"].startswith("Calculate ")
    assert rows[2]["answer"] == item["answer"] and rows[2]["entry"] == item
    assert rows[2]["task"] == {"name": "basic_arithmetic", "options": EASY}


def test_rows_are_a_pure_function_of_task_seed_and_size():
    rows = reasoning_gym_records("basic_arithmetic", 6, 0, EASY)
    assert rows == reasoning_gym_records("basic_arithmetic", 6, 0, EASY)
    assert reasoning_gym_records("basic_arithmetic", 9, 0, EASY)[:6] == rows  # a longer set starts the same
    other = [r["prompt"] for r in reasoning_gym_records("basic_arithmetic", 6, 1, EASY)]
    assert other != [r["prompt"] for r in rows]


def test_the_run_sizes_and_seeds_the_set():
    # 512 episodes / 32 per iteration = 16 iterations of 32 / 8 = 4 prompts, plus 20 held out: 84 rows
    cfg = run_config(holdout=20)
    assert generated_size(cfg) == 16 * 4 + 20
    records = run_prompt_records(cfg)
    assert len(records) == 84 and records.columns[0]["answer"]
    assert len(run_prompt_records(run_config(size=30))) == 30  # data.size wins
    # seeded from the run's seed, or from data.holdout_seed when set (runs that share it share the rows)
    seeded_1 = run_config()
    seeded_1.seed = 1
    assert list(run_prompt_records(seeded_1)) != list(run_prompt_records(run_config()))
    seeded_1.data.holdout_seed = 0
    assert list(run_prompt_records(seeded_1)) == list(run_prompt_records(run_config()))


def test_the_held_out_rows_are_the_same_every_time():
    from lmppo.data.prompts import PromptSet

    def held() -> list[str]:
        records = run_prompt_records(run_config(holdout=8))
        prompts = PromptSet(ids=[[i] for i in range(len(records))], texts=list(records), columns=records.columns)
        return split_holdout(prompts, 8, 0)[1].texts

    assert held() == held() and len(held()) == 8


def test_a_task_reasoning_gym_does_not_have_is_one_line_with_names_and_the_listing():
    with pytest.raises(ConfigError) as err:
        load_prompt_records(DataConfig(prompts="reasoning_gym:basic_arithmatic"), size=4)
    text = str(err.value)
    assert "\n" not in text and "reasoning_gym:basic_arithmatic" in text
    assert "basic_arithmetic" in text and "106 in all" in text and LIST_TASKS in text


@pytest.mark.parametrize(
    "options, words",
    [
        ({"max_term": 2}, ["unexpected keyword argument 'max_term'", "max_terms"]),
        ({"min_terms": 3, "max_terms": 2}, ["max_terms must be >= min_terms"]),
        ({"seed": 4}, ["`seed` is set by the run"]),
    ],
)
def test_options_the_task_refuses_are_one_line_naming_the_field(options, words):
    with pytest.raises(ConfigError) as err:
        load_prompt_records(DataConfig(prompts="reasoning_gym:basic_arithmetic", task_options=options), size=4)
    text = str(err.value)
    assert "\n" not in text and text.startswith("config field `data.task_options`")
    for word in words:
        assert word in text


def test_the_task_instruction_follows_each_question_and_leaves_the_entry_alone():
    records = load_prompt_records(
        DataConfig(
            prompts="reasoning_gym:basic_arithmetic", task_options=EASY, task_instruction="Answer with the number only."
        ),
        size=3,
    )
    for prompt, columns in zip(records, records.columns):
        assert prompt == f"{columns['entry']['question']} Answer with the number only."
        assert not columns["entry"]["question"].endswith("only.")
