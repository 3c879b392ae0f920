"""benchmarks/learning/verifiable.py's task input (`--problems`, `--heldout`, `--max-*`) and its per-task table: a bad
task file is one `error:` line before any model is loaded; a good one splits the same way every time."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO  # noqa: E402

ROOT = Path(REPO)
SCRIPT = ROOT / "benchmarks" / "learning" / "verifiable.py"
sys.path.insert(0, str(ROOT / "benchmarks" / "shared"))
import bench_path  # noqa: E402, F401  (every benchmark folder on the path)
import verifiable  # noqa: E402


def drive(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--sides", "grpo", "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")]
        + list(args),
        capture_output=True,
        text=True,
        timeout=60,
    )


def problems_file(tmp_path: Path, rows: list, name: str = "task.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = [{"prompt": f"What is {i} + 1?", "solution": i + 1} for i in range(20)]


@pytest.mark.parametrize(
    "bad_row, says",
    [
        ("{not json", "line 3: not JSON (Expecting property name enclosed in double quotes)"),
        ({"prompt": "  ", "solution": "1"}, "line 3: needs a non-empty text `prompt`"),
        ({"question": "2+2?", "solution": "4"}, "line 3: needs a non-empty text `prompt`"),
        ({"prompt": "2+2?"}, "line 3: needs a `solution` (text or number), got None"),
        ({"prompt": "2+2?", "solution": True}, "line 3: needs a `solution` (text or number), got True"),
        ({"prompt": "2+2?", "solution": ""}, "line 3: needs a `solution` (text or number), got ''"),
    ],
)
def test_a_bad_problem_line_is_one_error_line_naming_file_and_line(tmp_path, bad_row, says):
    path = problems_file(tmp_path, [GOOD[0], GOOD[1], bad_row])
    got = drive(tmp_path, "--problems", str(path))
    assert got.returncode == 1
    assert got.stderr.strip().splitlines() == [f"error: --problems {path} {says}"]
    assert not (tmp_path / "o").exists()  # nothing run, nothing written


def test_a_missing_task_file_and_bad_sizes_are_refused(tmp_path):
    got = drive(tmp_path, "--problems", str(tmp_path / "nope.jsonl"))
    assert got.stderr.strip().splitlines() == [
        f"error: --problems '{tmp_path / 'nope.jsonl'}' is not a file; give builtin:arithmetic, reasoning_gym:TASK or "
        "a .jsonl file"
    ]
    path = problems_file(tmp_path, GOOD)
    for heldout in ("0", "17"):  # 20 problems: one rollout's 4 prompts must stay for training
        got = drive(tmp_path, "--problems", str(path), "--heldout", heldout)
        assert got.stderr.strip().splitlines() == [
            f"error: --heldout {heldout} with 20 problems in {path}; allowed: 1 to 16 "
            "(one rollout's 4 prompts must stay for training)"
        ]
    got = drive(tmp_path, "--problems", str(path), "--max-new-tokens", "0")
    assert got.stderr.strip().splitlines() == ["error: --max-new-tokens 0; allowed: a positive whole number"]


def test_a_task_file_splits_into_held_out_and_training_problems_the_same_way_every_time(tmp_path):
    path = problems_file(tmp_path, GOOD + [""])  # a blank line is skipped
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    train_a, heldout_a = verifiable.split_problems(tmp_path / "a", str(path), 5)
    train_b, heldout_b = verifiable.split_problems(tmp_path / "b", str(path), 5)
    assert heldout_a == heldout_b and train_a.read_text() == train_b.read_text()
    trained = [json.loads(line) for line in train_a.read_text().splitlines()]
    assert len(heldout_a) == 5 and len(trained) == 15
    as_text = [{"prompt": r["prompt"], "solution": str(r["solution"])} for r in GOOD]
    assert sorted(map(json.dumps, heldout_a + trained)) == sorted(map(json.dumps, as_text))  # numbers become text


def test_the_table_has_one_part_per_task_and_old_rows_belong_to_arithmetic(tmp_path):
    row = {"episodes": 384, "tag": "", "heldout_kl": 4.0, "cpu_s": 500.0}
    rows = [
        {"side": "base", "episodes": 0, "seed": None, "heldout_exact_match": 0.3, "heldout_kl": 0.0},
        {**row, "side": "grpo", "seed": 0, "heldout_exact_match": 0.5},
        {**row, "side": "base", "task": "mine.jsonl", "episodes": 0, "seed": None, "heldout_exact_match": 0.1},
        {**row, "side": "grpo", "task": "mine.jsonl", "seed": 0, "heldout_exact_match": 0.2},
        {**row, "side": "grpo", "task": "mine.jsonl", "seed": 1, "heldout_exact_match": 0.4},
    ]
    out = tmp_path / "rows.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    arithmetic, mine = verifiable.table(out).split("\n\nTask mine.jsonl\n")
    assert arithmetic.startswith("Task builtin:arithmetic\n")
    assert "| lmppo `grpo` | 384 | 1 | 0.50 (0.50-0.50) |" in arithmetic
    assert "held-out exact match 0.10" in mine and "| lmppo `grpo` | 384 | 2 | 0.30 (0.20-0.40) |" in mine
    out.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    assert not verifiable.table(out).startswith("Task")  # one task: the table as before


def test_a_variant_is_named_by_its_overrides_and_kept_apart(tmp_path):
    """Rows run with `--extra` form their own line, named by the overrides; a tag without overrides names it too."""
    row = {"side": "grpo", "episodes": 1536, "heldout_kl": 4.0, "cpu_s": 500.0}
    rows = [
        {**row, "seed": 0, "tag": "", "extra": {}, "heldout_exact_match": 0.1},
        {**row, "seed": 0, "tag": "exloss", "extra": {"kl.placement": "loss"}, "heldout_exact_match": 0.5},
        {**row, "seed": 1, "tag": "exloss", "extra": {"kl.placement": "loss"}, "heldout_exact_match": 0.3},
        {**row, "seed": 0, "tag": "again", "heldout_exact_match": 0.2},
    ]
    text = verifiable.table(problems_file(tmp_path, rows, "rows.jsonl"))
    assert "| lmppo `grpo` | 1536 | 1 | 0.10 (0.10-0.10) |" in text
    assert '| lmppo `grpo` + `kl.placement: "loss"` | 1536 | 2 | 0.40 (0.30-0.50) |' in text
    assert "| lmppo `grpo` again | 1536 | 1 | 0.20 (0.20-0.20) |" in text


RG = "reasoning_gym:basic_arithmetic"
RG_TASK = {"size": 12, "options": {"min_terms": 2, "max_terms": 2, "max_digits": 1}, "instruction": "Answer."}


def test_a_reasoning_gym_task_is_its_rows_with_the_tasks_own_score_on_every_side(tmp_path):
    """reasoning-gym rows as lmppo's data.prompts makes them (entry and task kept for the reward), split as a file's;
    the reward is the task's score_answer, for the lmppo sides (the config's source), TRL's and the evaluator."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    train_a, heldout_a = verifiable.split_problems(tmp_path / "a", RG, 4, RG_TASK)
    train_b, heldout_b = verifiable.split_problems(tmp_path / "b", RG, 4, RG_TASK)
    assert heldout_a == heldout_b and train_a.read_text() == train_b.read_text()
    trained = [json.loads(line) for line in train_a.read_text().splitlines()]
    assert len(trained) == 8 and len(heldout_a) == 4
    row = heldout_a[0]
    assert row["prompt"].endswith(" Answer.") and row["solution"] == row["entry"]["answer"]
    assert row["task"] == {"name": "basic_arithmetic", "options": RG_TASK["options"]}
    assert verifiable.reward_of(RG) == "reasoning_gym" and verifiable.reward_of("builtin:arithmetic") == "exact_match"
    score = verifiable.task_reward("reasoning_gym")
    columns = {k: [r[k] for r in trained] for k in ("solution", "entry", "task")}
    right = [r["solution"] for r in trained]
    assert score(right, **columns) == [1.0] * 8
    assert score(["x"] * 8, **columns) == [0.0] * 8
    assert verifiable.REWARDS["reasoning_gym"] == "lmppo.rewards.builtin:reasoning_gym"


def test_a_task_reasoning_gym_refuses_is_one_error_line(tmp_path):
    got = drive(tmp_path, "--problems", "reasoning_gym:basic_arithmetc")
    assert got.returncode == 1
    (line,) = got.stderr.strip().splitlines()
    assert line.startswith("error: --problems reasoning_gym:basic_arithmetc: ") and "basic_arithmetic" in line
    got = drive(tmp_path, "--problems", RG, "--task-options", '{"max_digits": 0}')
    (line,) = got.stderr.strip().splitlines()
    assert line.startswith(f"error: --problems {RG}: ") and "data.task_options" in line
    got = drive(tmp_path, "--problems", RG, "--task-options", "[1]")
    assert got.returncode == 2 and "argument --task-options: '[1]' is not a JSON object" in got.stderr
    assert not (tmp_path / "o").exists()


def test_trl_runs_the_same_completions_and_optimizer_steps_as_lmppo_from_the_venv_of_its_version(tmp_path):
    import side_by_side

    arguments = side_by_side.trl_grpo_arguments(
        run_dir="r", seed=0, episodes=384, batch=32, group=8, max_new_tokens=16, settings=verifiable.SETTINGS
    )
    assert side_by_side.trl_episodes(arguments) == 384
    assert arguments["max_steps"] == side_by_side.optimizer_steps(384, 32) == 384 // 32 * 4
    assert (arguments["num_iterations"], arguments["steps_per_generation"]) == (2, 2)  # lmppo: 2 epochs x 2 minibatches
    assert (
        side_by_side.lmppo_steps({})["ppo.num_epochs"] == 2 and side_by_side.lmppo_steps({})["ppo.num_minibatches"] == 2
    )
    assert side_by_side.trl_python("", "1.16") == str(ROOT / ".venv-trl116" / "bin" / "python")
    assert side_by_side.trl_python("", "1.12") == str(ROOT / ".venv-trl" / "bin" / "python")
    assert side_by_side.trl_python("/x/python", "1.16") == "/x/python"
    got = drive(tmp_path, "--trl-version", "1.13")
    assert got.returncode == 2 and "--trl-version: invalid choice: '1.13'" in got.stderr


def test_a_reasoning_gym_table_shows_the_score_and_trl_by_its_version(tmp_path):
    row = {"episodes": 384, "tag": "", "task": RG, "cpu_s": 10.0}
    rows = [
        {**row, "side": "base", "seed": None, "heldout_score": 0.25, "heldout_kl": 0.0},
        {**row, "side": "trl", "seed": 0, "trl_version": "1.16.0", "heldout_score": 0.5, "heldout_kl": 8.0},
        {**row, "side": "trl", "seed": 1, "trl_version": "1.16.0", "heldout_score": 0.3, "heldout_kl": 6.0},
        {**row, "side": "trl", "seed": 0, "heldout_score": 0.1, "heldout_kl": 2.0},  # a 1.12 row (no version)
    ]
    text = verifiable.table(problems_file(tmp_path, rows, "rows.jsonl"))
    assert "Base model (before): held-out score (the task's score_answer) 0.25" in text
    assert "| TRL 1.16.0 GRPOTrainer | 384 | 2 | 0.40 (0.30-0.50) | 7.00 (6.00-8.00) | 10 |" in text
    assert "| TRL GRPOTrainer | 384 | 1 | 0.10 (0.10-0.10) |" in text


def test_each_task_runs_in_its_own_folder_under_work(tmp_path):
    # two tasks in one --work used to share run names: the second task's lmppo run was refused its folder
    a = verifiable.task_work(tmp_path, "reasoning_gym:chain_sum")
    b = verifiable.task_work(tmp_path, "reasoning_gym:basic_arithmetic")
    assert a != b and a.parent == b.parent == tmp_path
    assert a.name == "reasoning_gym_chain_sum"
    assert verifiable.task_work(tmp_path, "my dir/p.jsonl").name == "my_dir_p.jsonl"
