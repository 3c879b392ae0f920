"""Agents side by side: lmppo's modes (PPO with a critic, PPO with a shared value head, `grpo`, `rloo`) and TRL's
GRPOTrainer (`environment_factory`, in its own venv) on multi-turn games, SmolLM2-135M-Instruct with LoRA.

Tasks (`--tasks`): `guess_number` (lmppo's higher/lower game, src/lmppo/recipes/guess_number.yaml) and TextArena
single-player games, `textarena:ENV_ID` (`environment.path: textarena:ENV_ID`, rows `builtin:textarena`: one game
seed each; `python -m lmppo.environments.textarena_games` lists the ids that run here).

Equal on every side: the guess_number recipe's settings (LoRA r16 / alpha 32 / all-linear, AdamW at a constant 7e-4,
temperature 0.7, its KL) in fp32, `--batch` episodes per rollout (16), each rollout trained on in 2 epochs x 2
minibatches (4 optimizer steps; TRL: num_iterations 2, steps_per_generation 2), `--episodes` episodes in all (so the
same optimizer steps), the same training games and the same `--heldout` held-out games for every side and seed
(`data.holdout_seed` 1234; a TextArena game set of `--heldout` + `--episodes` rows). The group sides (`grpo`,
`rloo`, TRL) play `--group` episodes of each game (4; `ppo.vf_coef 0`). Each task's per-turn budgets: TASKS below.

Measured per run, by lmppo's own held-out evaluation (the end-of-run summary of `lmppo train`, summary.json; on TRL's
merged policy `lmppo eval` with the same config): held-out success (`reward/environment`: games won, or the game's
reward at its end) of the start and of the trained policy, 4 episodes per held-out game at temperature 0.7 on the
same random streams, the exact KL to the start summed over the policy's tokens (`kl_exact`), wall seconds and the
worker's CPU seconds (user + system, `os.wait4`: loading and the summary included). One JSON row per run (with the
commit) is appended to `--out` as soon as it ends; `--table` prints one markdown table per task (mean, min-max over
seeds). A TRL run that TRL refuses is a row with TRL's own error line (`error`).

    python benchmarks/learning/agents.py --tasks guess_number,textarena:GuessTheNumber-v0 --seeds 0,1,2 \
        --episodes 192 [--sides trl,ppo_critic,ppo_shared,grpo,rloo] [--trl-python /work/venv-trl116/bin/python]
    python benchmarks/learning/agents.py --table [--out benchmarks/results/agents.jsonl]
Variants: `--extra '{"ppo.lam": 1.0}'` (JSON of config overrides for the lmppo sides) with `--tag NAME`.
Worker modes (used by the driver): --worker trl --cfg run.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))
import bench_path  # noqa: E402
from side_by_side import (  # noqa: E402
    REPO,
    add_trl_options,
    append_row,
    by_side,
    by_task,
    check_positive,
    check_sides,
    commit,
    json_object,
    libraries,
    lmppo_sides,
    lmppo_steps,
    merge,
    model_dir,
    nested,
    optimizer_steps,
    read_rows,
    run_child,
    save_merged,
    spread,
    trl_grpo_arguments,
    trl_model,
    trl_python,
    worker_env,
)

RECIPE = REPO / "src/lmppo/recipes/guess_number.yaml"
BATCH, GROUP, HELDOUT, EPISODES = 16, 4, 24, 192
HOLDOUT_SEED = 1234
"""The held-out games (and TextArena's game set) of every side and seed."""
SETTINGS = dict(lr=7e-4, temperature=0.7, lora_r=16, lora_alpha=32)  # the recipe's, TRL told the same
TEXTARENA = "textarena:"
TASKS: dict[str, dict[str, object]] = {
    "guess_number": {},  # the recipe as it ships: 4 turns of 6 tokens, 80 tokens an episode
}
TEXTARENA_TASK = {
    "data.prompts": "builtin:textarena",
    "environment.max_turns": 10,
    "environment.max_episode_tokens": 512,
    "environment.max_observation_tokens": 256,
    "rollout.max_new_tokens": 16,
    "ppo.micro_batch_size": 4,
    "kl.controller": "fixed",  # the TextArena rows' KL (a fixed 0.02), kept when the recipe took the PI controller
    "kl.coef": 0.02,
}
"""A TextArena game's settings (any `textarena:ENV_ID`): a turn of 16 tokens, 10 turns, 512 tokens an episode,
micro-batches of 4 episodes (the same update as the recipe's 8, in two steps of gradient accumulation: at 8 a
GuessTheNumber-v0 run grew past 16 GB in its second iteration and was killed for memory beside another run; at 4
its peak was 11 GB, measured with `/usr/bin/time -v`), and the fixed beta of 0.02 the TextArena rows ran with."""
LMPPO_SIDES = {side: v for side, v in lmppo_sides(GROUP).items() if side != "grpo_exact"}
SIDES = ["trl", *LMPPO_SIDES]
SHOWN = {"trl": "TRL GRPOTrainer", **{side: f"lmppo `{side}`" for side in LMPPO_SIDES}}


def task_overrides(task: str) -> dict[str, object]:
    """The settings of `task` on top of the recipe; one `error:` line for a task that is neither."""
    if task in TASKS:
        return dict(TASKS[task])
    if task.startswith(TEXTARENA) and len(task) > len(TEXTARENA):
        return {**TEXTARENA_TASK, "environment.path": task}
    sys.exit(f"error: --tasks {task!r} unknown; allowed: {', '.join(TASKS)} or textarena:ENV_ID")


def run_config(
    *, task: str, side: str, seed: int, episodes: int, heldout: int, model: str, run_dir: str, extra: dict
) -> dict:
    """The whole `lmppo train` config (the recipe's YAML with this run's overrides) of an lmppo side; TRL's side
    gets `grpo`'s (its group; its evaluation reads the task, the held-out games and the sampling from it)."""
    import yaml

    overrides = {
        "output_dir": run_dir,
        "seed": seed,
        "total_episodes": episodes,
        "precision": "fp32",
        "model.policy": model,
        "data.holdout": heldout,
        "data.holdout_seed": HOLDOUT_SEED,
        "rollout.batch_size": BATCH,
        "log.progress": False,
        "log.sample_every": 0,
        **task_overrides(task),
    }
    if task.startswith(TEXTARENA):
        overrides["data.size"] = heldout + episodes
    overrides.update(LMPPO_SIDES["grpo" if side == "trl" else side])
    overrides.update(extra if side != "trl" else {})
    return merge(yaml.safe_load(RECIPE.read_text()), nested(lmppo_steps(overrides)))


def checked(config: dict) -> object:
    """The config as lmppo reads it, validated: a bad `--extra` or task is one `error:` line before a model loads."""
    bench_path.put_first(bench_path.SRC)
    from lmppo.config import Config
    from lmppo.config.fields import from_dict
    from lmppo.errors import LmppoError

    try:
        cfg = from_dict(Config, config)
        cfg.validate()
    except LmppoError as err:
        sys.exit(f"error: {err}")
    return cfg


def trl_arguments(config: dict, run_dir: str) -> dict:
    """TRL's GRPOConfig arguments for the run `config` describes: its episodes, batch, seed and turn budget."""
    env = config["environment"]
    return trl_grpo_arguments(
        run_dir=run_dir,
        seed=config["seed"],
        episodes=config["total_episodes"],
        batch=config["rollout"]["batch_size"],
        group=GROUP,
        max_new_tokens=env["max_episode_tokens"],  # TRL's budget is the whole episode's
        settings=SETTINGS,
    ) | {"max_tool_calling_iterations": env["max_turns"]}


def training_rows(config: dict) -> list[dict]:
    """The training games of the run (its prompt rows without the held-out ones, split as lmppo splits them):
    `prompt` and the row's columns."""
    import torch

    from lmppo.data.prompts import run_prompt_records

    cfg = checked(config)
    records = run_prompt_records(cfg)
    held = set(
        torch.randperm(len(records), generator=torch.Generator().manual_seed(HOLDOUT_SEED + 7)).tolist()[
            : cfg.data.holdout
        ]
    )
    return [{"prompt": str(records[i]), **records.columns[i]} for i in range(len(records)) if i not in held]


# ------------------------------------------------------------------------------------------------ TRL's worker
class TrlGame:
    """lmppo's environment of `PATH` in TRL's `environment_factory` shape: `reset(**row)` builds the row's game and
    returns its opening, `move` is the one tool (a turn of the game), `get_reward` the episode's total."""

    PATH = ""

    def __init__(self) -> None:
        self.game: object = None
        self.total, self.done = 0.0, False

    def reset(self, **row: object) -> str:
        from lmppo.environments.api import constructor_arguments, load_environment

        factory = load_environment(self.PATH)
        columns = {k: v for k, v in row.items() if k not in ("prompt", "row_prompt")} | {"prompt": row["row_prompt"]}
        self.game = factory(**constructor_arguments(factory, columns))
        self.total, self.done = 0.0, False
        return self.game.reset()

    def move(self, text: str) -> str:
        """Play one move of the game.

        Args:
            text: the move, written as the game asks for it
        """
        if self.done:
            raise ValueError("the game is over")
        observation, reward, self.done = self.game.step(text)
        self.total += float(reward)
        return observation or "The game is over."

    def get_reward(self) -> float:
        return self.total


def trl_worker(cfg: dict) -> None:
    """TRL's GRPOTrainer with `environment_factory` on the run's training games; TRL's refusal (an exception) is
    written as its one line to the result file and ends the worker with exit 1."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO / "src"))
    sys.path.append(cfg["libraries"])  # TextArena from lmppo's venv, after TRL's own packages
    from datasets import Dataset

    import trl
    from trl import GRPOConfig, GRPOTrainer

    TrlGame.PATH = cfg["environment"]
    rows = [
        {
            "prompt": [{"role": "user", "content": ""}],
            "row_prompt": r["prompt"],
            **{k: v for k, v in r.items() if k != "prompt"},
        }
        for r in cfg["rows"]
    ]
    tokenizer, model, lora = trl_model(cfg["model_dir"], SETTINGS)
    if cfg["chat_template"]:  # one of TRL's own templates (trl/chat_templates/NAME.jinja) in place of the model's
        tokenizer.chat_template = (
            Path(trl.__file__).parent / "chat_templates" / f"{cfg['chat_template']}.jinja"
        ).read_text()
    result = {"trl_version": trl.__version__}
    try:
        trainer = GRPOTrainer(
            model=model,
            args=GRPOConfig(**cfg["arguments"]),
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            peft_config=lora,
            environment_factory=TrlGame,
        )
        trainer.train()
    except Exception as err:  # TRL's refusal, recorded as its own line
        Path(cfg["result"]).write_text(json.dumps(result | {"error": f"{type(err).__name__}: {err}"}))
        raise
    save_merged(trainer, tokenizer, cfg["policy_dir"])
    Path(cfg["result"]).write_text(json.dumps(result | {"steps": cfg["arguments"]["max_steps"]}))


# ------------------------------------------------------------------------------------------------ driver
def heldout_figures(before: dict, after: dict) -> dict:
    """A row's held-out figures from lmppo's evaluation (the summary's or `lmppo eval`'s before / after means)."""
    return {
        "success_before": before["reward/environment"],
        "success_after": after["reward/environment"],
        "heldout_kl": after["kl_exact"],
        "heldout_kl_k1": after["kl"],
        "policy_tokens_after": after["length"],
    }


def lmppo_run(a: argparse.Namespace, config: dict, run_dir: Path) -> tuple[int, float, dict]:
    """`lmppo train` on the run's config; (exit code, CPU s, the row's figures from its summary.json)."""
    import yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = worker_env(PYTHONPATH=str(bench_path.SRC))
    rc, cpu = run_child([a.lmppo_python, "-m", "lmppo", "train", str(path)], run_dir.with_suffix(".log"), env)
    if rc != 0:
        return rc, cpu, {}
    summary = json.loads((run_dir / "summary.json").read_text())
    return rc, cpu, heldout_figures(summary["before"], summary["after"])


def trl_run(a: argparse.Namespace, config: dict, run_dir: Path, model: str) -> tuple[int, float, dict]:
    """TRL's worker on the run's training games, then `lmppo eval` of its merged policy with the run's config;
    (exit code, CPU s of training, the row's figures or TRL's error line)."""
    import yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    arguments = trl_arguments(config, str(run_dir / "trl"))
    cfg = {
        "model_dir": model,
        "environment": config["environment"]["path"],
        "rows": training_rows(config),
        "arguments": arguments,
        "policy_dir": str(run_dir / "merged"),
        "result": str(run_dir / "result.json"),
        "libraries": libraries(a.lmppo_python),
        "chat_template": a.trl_chat_template,
    }
    cfg_file = run_dir / "trl.json"
    cfg_file.write_text(json.dumps(cfg))
    trl = trl_python(a.trl_python, a.trl_version)
    env = worker_env(PYTHONPATH=str(bench_path.SRC), TRL_EXPERIMENTAL_SILENCE="1")
    rc, cpu = run_child([trl, __file__, "--worker", "trl", "--cfg", str(cfg_file)], run_dir / "trl.log", env)
    result = json.loads(Path(cfg["result"]).read_text()) if Path(cfg["result"]).is_file() else {}
    if rc != 0:
        return rc, cpu, result or {"error": f"the TRL worker ended with exit {rc} (log {run_dir / 'trl.log'})"}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    out = run_dir / "eval.json"
    command = [
        a.lmppo_python,
        "-m",
        "lmppo",
        "eval",
        cfg["policy_dir"],
        "--config",
        str(run_dir / "config.yaml"),
        "--reference",
        model,
        "--output",
        str(out),
    ]
    rc, _ = run_child(command, run_dir / "eval.log", worker_env(PYTHONPATH=str(bench_path.SRC)))
    if rc != 0:
        return rc, cpu, {"error": f"lmppo eval ended with exit {rc} (log {run_dir / 'eval.log'})"}
    evaluation = json.loads(out.read_text())
    return rc, cpu, result | heldout_figures(evaluation["start_point"], evaluation["trained"])


def drive(a: argparse.Namespace) -> None:
    work = Path(a.work or tempfile.mkdtemp(prefix="agents-"))
    work.mkdir(parents=True, exist_ok=True)
    model = a.model or model_dir(a.lmppo_python)
    plans = []
    for task in a.tasks:
        for seed in a.seeds:
            for side in a.sides:
                tag = f"{task.replace(':', '_')}-{side}-{a.episodes}-s{seed}{a.tag}"
                config = run_config(
                    task=task,
                    side=side,
                    seed=seed,
                    episodes=a.episodes,
                    heldout=a.heldout,
                    model=model,
                    run_dir=str(work / tag),
                    extra=a.extra,
                )
                checked(config)  # every run's config before the first one starts
                plans.append((task, seed, side, tag, config))
    at = commit()
    for task, seed, side, tag, config in plans:
        started = time.time()
        if side == "trl":
            rc, cpu, figures = trl_run(a, config, work / tag, model)
        else:
            rc, cpu, figures = lmppo_run(a, config, work / tag)
        if rc != 0 and "error" not in figures:
            print(f"{tag}: failed (exit {rc}), log in {work}", flush=True)
            continue
        row = {
            "side": side,
            "task": task,
            "episodes": a.episodes,
            "seed": seed,
            "tag": a.tag,
            "extra": side_extra(a, side),
            "commit": at,
            "optimizer_steps": optimizer_steps(a.episodes, BATCH),
            "heldout_games": a.heldout,
            **figures,
            "cpu_s": round(cpu, 1),
            "wall_s": round(time.time() - started, 1),
        }
        append_row(Path(a.out), row)


def side_extra(a: argparse.Namespace, side: str) -> dict:
    """What a row's side ran with beyond the harness's settings (its name in the table): `--extra` on lmppo's sides,
    `--trl-chat-template` on TRL's."""
    if side == "trl":
        return {"trl chat template": a.trl_chat_template} if a.trl_chat_template else {}
    return a.extra


# ------------------------------------------------------------------------------------------------ table
def table(path: Path) -> str:
    """One markdown table per task: per (side, episodes), the seeds and mean (min-max) of each figure."""
    tasks = by_task(read_rows(path))
    return "\n\n".join(task_table(task, rows) for task, rows in tasks.items())


def task_table(task: str, rows: list[dict]) -> str:
    lines = [
        f"Task {task}\n",
        "| side | episodes | seeds | held-out success before | after (mean, min-max) | held-out KL to the start "
        "(nats) | CPU s | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (side, episodes), rs in by_side(rows, SHOWN):
        refused = [r for r in rs if r.get("error")]
        ran = [r for r in rs if not r.get("error")]
        if ran:
            lines.append(
                f"| {side} | {episodes} | {len(ran)} | {spread([r['success_before'] for r in ran])} | "
                f"{spread([r['success_after'] for r in ran])} | {spread([r['heldout_kl'] for r in ran])} | "
                f"{mean_measured(ran, 'cpu_s')} | {mean_measured(ran, 'wall_s')} |"
            )
        for error in dict.fromkeys(r["error"] for r in refused):  # each distinct refusal once
            seeds = sum(r["error"] == error for r in refused)
            lines.append(f"| {side} | {episodes} | {seeds} | did not run: {error} | | | | |")
    return "\n".join(lines)


def mean_measured(rows: list[dict], key: str) -> str:
    """The mean of `key` over the rows that measured it (a row written from a finished run's summary.json after its
    driver was stopped has no CPU seconds: `null`); "-" when none did."""
    measured = [r[key] for r in rows if r.get(key) is not None]
    return f"{statistics.mean(measured):.0f}" if measured else "-"


# ------------------------------------------------------------------------------------------------ command line
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=["trl"])
    p.add_argument("--cfg")
    p.add_argument("--table", action="store_true", help="print the tables of --out and stop")
    p.add_argument(
        "--tasks",
        type=lambda s: s.split(","),
        default=["guess_number"],
        help="comma-separated: guess_number, textarena:ENV_ID",
    )
    p.add_argument("--sides", type=lambda s: s.split(","), default=SIDES, help="comma-separated: " + ", ".join(SIDES))
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--episodes", type=int, default=EPISODES, help=f"episodes per run, a multiple of {BATCH}")
    p.add_argument("--heldout", type=int, default=HELDOUT, help="held-out games (4 episodes each, before and after)")
    p.add_argument("--model", default="", help="the policy's folder (default: SmolLM2-135M-Instruct)")
    add_trl_options(p, "1.16")
    p.add_argument(
        "--trl-chat-template",
        default="",
        help="TRL's side only: one of TRL's chat templates (trl/chat_templates/NAME.jinja, e.g. qwen2_5) in place of "
        "the model's, for a model whose own template renders no tools (a variant: the prompts then differ)",
    )
    p.add_argument("--extra", type=json_object, default={}, help="JSON dict of config overrides for the lmppo sides")
    p.add_argument("--tag", default="", help="suffix of the side's name in the table (a variant)")
    p.add_argument("--work", default="")
    p.add_argument("--out", default=str(REPO / "benchmarks/results/agents.jsonl"))
    return p


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    if a.worker:
        trl_worker(json.loads(Path(a.cfg).read_text()))
    elif a.table:
        print(table(Path(a.out)))
    else:
        check_positive(a, ("episodes", "heldout"))
        if a.episodes % BATCH:
            sys.exit(f"error: --episodes {a.episodes}; allowed: a multiple of {BATCH} (episodes per rollout)")
        check_sides(a.sides, SIDES)
        for task in a.tasks:
            task_overrides(task)
        drive(a)


if __name__ == "__main__":
    main()
