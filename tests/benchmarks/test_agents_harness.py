"""benchmarks/learning/agents.py: the configs each side builds (equal episodes and optimizer steps, the same held-out
games), its argument errors (one `error:` line before any model loads), the table's arithmetic on hand-written rows,
and one tiny end-to-end run through `lmppo train` and its summary."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO  # noqa: E402

ROOT = Path(REPO)
SCRIPT = ROOT / "benchmarks" / "learning" / "agents.py"
sys.path.insert(0, str(ROOT / "benchmarks" / "learning"))
import agents  # noqa: E402  (puts benchmarks/shared and the other benchmark folders on the path)
import side_by_side  # noqa: E402

TASKS = ["guess_number", "textarena:GuessTheNumber-v0"]


def config(task: str, side: str, **kw):
    fields = dict(task=task, side=side, seed=3, episodes=64, heldout=8, model="smollm2", run_dir="/r", extra={})
    return agents.run_config(**{**fields, **kw})


def optimizer_steps_of(cfg: dict) -> int:
    """What lmppo runs: total_episodes // batch_size rollouts of num_epochs x num_minibatches optimizer steps."""
    return (
        cfg["total_episodes"] // cfg["rollout"]["batch_size"] * cfg["ppo"]["num_epochs"] * cfg["ppo"]["num_minibatches"]
    )


@pytest.mark.parametrize("task", TASKS)
def test_every_side_runs_the_same_episodes_and_optimizer_steps_on_the_same_games(task):
    configs = {side: config(task, side) for side in agents.SIDES}
    for side, cfg in configs.items():
        assert cfg["total_episodes"] == 64 and optimizer_steps_of(cfg) == 16, side  # 4 rollouts of 16, 4 steps each
        assert (cfg["data"]["holdout"], cfg["data"]["holdout_seed"]) == (8, agents.HOLDOUT_SEED), side
        assert cfg["model"]["lora"] == {"enabled": True, "r": 16, "alpha": 32, "target_modules": ["all-linear"]}
        assert cfg["ppo"]["learning_rate"] == 7e-4 and cfg["rollout"]["temperature"] == 0.7
    trl = agents.trl_arguments(configs["trl"], "/r/trl")
    assert side_by_side.trl_episodes(trl) == 64 and trl["max_steps"] == 16  # TRL: the same completions and steps
    assert trl["num_generations"] == configs["grpo"]["rollout"]["num_samples_per_prompt"] == 4
    assert trl["max_tool_calling_iterations"] == configs["grpo"]["environment"]["max_turns"]
    assert (configs["ppo_critic"]["value"]["mode"], configs["ppo_shared"]["value"]["mode"]) == ("critic", "shared")
    for side in ("grpo", "rloo"):
        assert configs[side]["ppo"]["advantage_estimator"] == side and configs[side]["ppo"]["vf_coef"] == 0.0
    assert "num_samples_per_prompt" not in configs["ppo_critic"]["rollout"]  # one episode per game: the recipe's


def test_a_textarena_task_plays_its_game_on_one_set_of_games_and_guess_number_is_the_recipe():
    arena = config("textarena:GuessTheNumber-v0", "ppo_critic")
    assert arena["environment"]["path"] == "textarena:GuessTheNumber-v0"
    assert arena["data"]["prompts"] == "builtin:textarena" and arena["data"]["size"] == 8 + 64
    assert arena["rollout"]["max_new_tokens"] == 16 and arena["environment"]["max_turns"] == 10
    assert arena["ppo"]["micro_batch_size"] == 4  # 8 ran out of memory beside another run (TEXTARENA_TASK)
    assert arena["kl"]["controller"] == "fixed" and arena["kl"]["coef"] == 0.02  # what the TextArena rows ran with
    game = config("guess_number", "ppo_critic")
    assert game["environment"] == {
        "path": "guess_number",
        "max_turns": 4,
        "max_episode_tokens": 80,
        "max_observation_tokens": 64,
    }
    assert game["data"]["prompts"] == "builtin:guess_number" and "size" not in game["data"]
    assert game["kl"]["controller"] == "pi" and game["kl"]["target"] == 4.0  # the recipe's, as it ships


def test_overrides_reach_the_lmppo_sides_only_and_are_checked_by_lmppo():
    assert config("guess_number", "grpo", extra={"ppo.lam": 1.0})["ppo"]["lam"] == 1.0
    assert config("guess_number", "trl", extra={"ppo.lam": 1.0})["ppo"]["lam"] == 0.95  # the recipe's
    with pytest.raises(SystemExit) as stop:
        agents.checked(config("guess_number", "grpo", extra={"ppo.num_epochs": 0}))
    assert str(stop.value).startswith("error: ") and "ppo.num_epochs" in str(stop.value)


def test_the_trl_workers_games_are_the_training_rows_lmppo_trains_on():
    """The held-out games are the ones lmppo's split keeps out (seed HOLDOUT_SEED): disjoint from TRL's rows."""
    from lmppo.data.prompts import PromptSet, run_prompt_records, split_holdout

    cfg = config("textarena:GuessTheNumber-v0", "trl")
    rows = agents.training_rows(cfg)
    records = run_prompt_records(agents.checked(cfg))
    seeds = [c["game_seed"] for c in records.columns]
    prompts = PromptSet([[i] for i in range(len(seeds))], [str(s) for s in seeds])
    train, held = split_holdout(prompts, 8, agents.HOLDOUT_SEED)
    assert [r["game_seed"] for r in rows] == [int(t) for t in train.texts]
    assert not {r["game_seed"] for r in rows} & {int(t) for t in held.texts} and len(rows) == 64


def drive(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o.jsonl"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (["--tasks", "chess"], "error: --tasks 'chess' unknown; allowed: guess_number or textarena:ENV_ID"),
        (["--tasks", "textarena:"], "error: --tasks 'textarena:' unknown; allowed: guess_number or textarena:ENV_ID"),
        (["--sides", "grpo,dpo"], "error: --sides ['dpo'] unknown; allowed: trl, ppo_critic, ppo_shared, grpo, rloo"),
        (["--episodes", "40"], "error: --episodes 40; allowed: a multiple of 16 (episodes per rollout)"),
        (["--episodes", "0"], "error: --episodes 0; allowed: a positive whole number"),
        (["--heldout", "0"], "error: --heldout 0; allowed: a positive whole number"),
    ],
)
def test_argument_errors_are_one_line_and_run_nothing(tmp_path, args, says):
    got = drive(tmp_path, "--model", str(tmp_path / "no-model"), *args)
    assert got.returncode == 1
    assert got.stderr.strip().splitlines() == [says]
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "w").exists()


def write_rows(tmp_path: Path, rows: list[dict]) -> Path:
    out = tmp_path / "rows.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def test_the_table_is_one_per_task_with_mean_and_min_max_over_seeds(tmp_path):
    run = {"episodes": 192, "tag": "", "extra": {}, "heldout_kl_k1": 0.0, "wall_s": 100.0}
    rows = [
        {
            **run,
            "task": "guess_number",
            "side": "grpo",
            "seed": 0,
            "success_before": 0.1,
            "success_after": 0.5,
            "heldout_kl": 2.0,
            "cpu_s": 300.0,
        },
        {
            **run,
            "task": "guess_number",
            "side": "grpo",
            "seed": 1,
            "success_before": 0.2,
            "success_after": 0.8,
            "heldout_kl": 4.0,
            "cpu_s": 500.0,
        },
        {
            **run,
            "task": "guess_number",
            "side": "grpo",
            "seed": 2,
            "success_before": 0.0,
            "success_after": 0.2,
            "heldout_kl": 3.0,
            "cpu_s": 400.0,
        },
        {
            **run,
            "task": "textarena:X-v0",
            "side": "ppo_critic",
            "seed": 0,
            "success_before": 0.25,
            "success_after": 0.75,
            "heldout_kl": 1.0,
            "cpu_s": 10.0,
            "wall_s": 20.0,
        },
    ]
    games, arena = agents.table(write_rows(tmp_path, rows)).split("\n\nTask textarena:X-v0\n")
    assert games.startswith("Task guess_number\n")
    # means 0.10, 0.50, 3.00; CPU 400, wall 100
    assert "| lmppo `grpo` | 192 | 3 | 0.10 (0.00-0.20) | 0.50 (0.20-0.80) | 3.00 (2.00-4.00) | 400 | 100 |" in games
    assert "ppo_critic" not in games
    assert (
        "| lmppo `ppo_critic` | 192 | 1 | 0.25 (0.25-0.25) | 0.75 (0.75-0.75) | 1.00 (1.00-1.00) | 10 | 20 |" in arena
    )


def test_a_row_without_cpu_seconds_counts_in_every_figure_but_the_cpu_mean(tmp_path):
    # a row written from a finished run's summary.json after its driver was stopped: no os.wait4 figure
    run = {"task": "guess_number", "side": "grpo", "episodes": 48, "tag": "", "extra": {}, "success_before": 0.0}
    rows = [
        {**run, "seed": 0, "success_after": 0.2, "heldout_kl": 2.0, "cpu_s": 300.0, "wall_s": 310.0},
        {**run, "seed": 1, "success_after": 0.4, "heldout_kl": 4.0, "cpu_s": None, "wall_s": 890.0},
    ]
    text = agents.table(write_rows(tmp_path, rows))
    assert "| lmppo `grpo` | 48 | 2 | 0.00 (0.00-0.00) | 0.30 (0.20-0.40) | 3.00 (2.00-4.00) | 300 | 600 |" in text
    only = agents.table(write_rows(tmp_path, rows[1:]))
    assert "| 4.00 (4.00-4.00) | - | 890 |" in only


def test_a_row_run_at_a_smaller_micro_batch_joins_its_cell_and_a_real_variant_does_not(tmp_path):
    # micro-batches split the same minibatch (gradient accumulation): the same update, run to fit in memory
    run = {"task": "guess_number", "side": "ppo_critic", "episodes": 48, "success_before": 0.0, "cpu_s": 1.0}
    rows = [
        {**run, "seed": 0, "tag": "", "extra": {}, "success_after": 0.2, "heldout_kl": 2.0, "wall_s": 1.0},
        {**run, "seed": 1, "tag": "mbs2", "extra": {"ppo.micro_batch_size": 2}, "success_after": 0.4,
         "heldout_kl": 4.0, "wall_s": 1.0},
        {**run, "seed": 0, "tag": "lam1", "extra": {"ppo.lam": 1.0, "ppo.micro_batch_size": 2}, "success_after": 0.9,
         "heldout_kl": 9.0, "wall_s": 1.0},
    ]  # fmt: skip
    text = agents.table(write_rows(tmp_path, rows))
    assert "| lmppo `ppo_critic` | 48 | 2 | 0.00 (0.00-0.00) | 0.30 (0.20-0.40) | 3.00 (2.00-4.00) | 1 | 1 |" in text
    assert "| lmppo `ppo_critic` + `ppo.lam: 1.0` | 48 | 1 | 0.00 (0.00-0.00) | 0.90 (0.90-0.90) |" in text
    assert "mbs2" not in text and "micro_batch_size" not in text


def test_a_refused_trl_run_shows_its_error_line_and_variants_are_kept_apart(tmp_path):
    refused = {
        "task": "guess_number",
        "side": "trl",
        "episodes": 192,
        "tag": "",
        "extra": {},
        "cpu_s": 9.0,
        "wall_s": 9.0,
        "trl_version": "1.16.0",
        "error": "ValueError: The provided chat template does not support tool calling.",
    }
    ran = {
        "task": "guess_number",
        "side": "rloo",
        "episodes": 192,
        "tag": "",
        "extra": {},
        "success_before": 0.0,
        "success_after": 0.5,
        "heldout_kl": 1.0,
        "cpu_s": 1.0,
        "wall_s": 1.0,
    }
    rows = [
        {**refused, "seed": 0},
        {**refused, "seed": 1},
        {**ran, "seed": 0},
        {**ran, "seed": 0, "extra": {"ppo.lam": 1.0}, "success_after": 0.9},
    ]
    text = agents.table(write_rows(tmp_path, rows))
    assert (
        "| TRL 1.16.0 GRPOTrainer | 192 | 2 | did not run: ValueError: The provided chat template does not support "
        "tool calling. | | | | |"
    ) in text
    assert "| lmppo `rloo` | 192 | 1 | 0.00 (0.00-0.00) | 0.50 (0.50-0.50) |" in text
    assert "| lmppo `rloo` + `ppo.lam: 1.0` | 192 | 1 | 0.00 (0.00-0.00) | 0.90 (0.90-0.90) |" in text


@pytest.mark.slow
def test_a_tiny_run_of_one_side_appends_its_row_from_lmppos_summary(tmp_path, tiny_model_dir):
    """One lmppo side end to end on a tiny model: `lmppo train` runs the config, its summary.json gives the row."""
    got = drive(
        tmp_path, "--model", tiny_model_dir, "--sides", "grpo", "--seeds", "5", "--episodes", "16", "--heldout", "2"
    )
    assert got.returncode == 0, got.stdout + got.stderr
    (row,) = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "w" / "guess_number-grpo-16-s5" / "summary.json").read_text())
    assert (row["side"], row["task"], row["seed"], row["episodes"], row["optimizer_steps"]) == (
        "grpo",
        "guess_number",
        5,
        16,
        4,
    )
    assert row["success_before"] == summary["before"]["reward/environment"]
    assert row["success_after"] == summary["after"]["reward/environment"]
    assert row["heldout_kl"] == summary["after"]["kl_exact"] and summary["heldout_prompts"] == 2
    assert summary["training"]["episodes"] == 16 and row["cpu_s"] > 0 and row["commit"]


def test_trls_chat_template_variant_and_lmppos_overrides_name_their_rows():
    a = agents.parser().parse_args(["--trl-chat-template", "qwen2_5", "--extra", '{"ppo.lam": 1.0}'])
    assert agents.side_extra(a, "trl") == {"trl chat template": "qwen2_5"}
    assert agents.side_extra(a, "grpo") == {"ppo.lam": 1.0}
    row = {"side": "trl", "trl_version": "1.16.0", "extra": agents.side_extra(a, "trl")}
    assert side_by_side.label(row, agents.SHOWN) == 'TRL 1.16.0 GRPOTrainer + `trl chat template: "qwen2_5"`'
    assert agents.side_extra(agents.parser().parse_args([]), "trl") == {}
