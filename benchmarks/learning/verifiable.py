"""Side by side on a verifiable reward: lmppo (PPO with a critic, PPO with a shared value head, `grpo`, `grpo_exact`,
`rloo`) and TRL's GRPOTrainer (1.12 or 1.16, `--trl-version`, each in its own venv, as `make bench` runs TRL),
SmolLM2-135M-Instruct learning small arithmetic or a reasoning-gym task. What both learning harnesses share (the
sides, TRL's arguments, the workers, the rows, mean (min-max)) is benchmarks/shared/side_by_side.py.

Task: `builtin:arithmetic` (480 problems: sums, differences, products, "Answer with the number only."), split once
by a fixed seed into 380 training problems and 100 held-out ones, prompts through the chat template. Reward: lmppo's
`lmppo.rewards.builtin:exact_match` (1 if the final number equals the solution), on both sides.

Equal on every side: LoRA r16 / alpha 32 / all-linear / no dropout, fp32, 1 thread, 16 new tokens at temperature
0.7, AdamW at a constant 7e-4 (eps 1e-5, grad-norm clip 1.0), 32 completions per rollout and 4 optimizer steps of
16 completions on each rollout (2 epochs x 2 minibatches; TRL: steps_per_generation 2, num_iterations 2), the same
completions in all (`--episodes`). Group sides (lmppo grpo/rloo, TRL) sample 8 completions per prompt; ratio clip
0.2, top_k 0 / top_p 1 on both. Everything else is each side's default: TRL's GRPOTrainer (1.12 and 1.16 alike)
`beta 0` (no KL term), `loss_type dapo` (token sum over the generation batch's token count: a token mean, as lmppo's),
`scale_rewards group` (group std with Bessel's correction, + 1e-4; lmppo's grpo: population std, + 1e-6, then
`ppo.whiten_advantages` over the tokens of rows with a signal), and the Trainer's AdamW step on every batch, an
all-zero gradient included (its moments keep moving the weights; lmppo takes no step on a batch without signal);
lmppo the arithmetic recipe's KL (PI controller, target 5 nats, starting beta 0.05): in the
rewards (k1) on every lmppo side but `grpo_exact`, where it is the exact KL as a loss term.

Measured per run, by one evaluator in lmppo's venv on the saved, merged policy: held-out exact match of greedy
answers (100 problems) before and after, the KL to the base model on the held-out prompts (exact per-token KL summed
over a response sampled at temperature 0.7, 2 per prompt, mean), and the worker's CPU seconds (user + system of the
training process, `os.wait4`: loading included). One JSON row per run is appended to `--out` as soon as it ends, so
an interrupted grid keeps what ran; `--table` prints the markdown table (mean, min-max over seeds) from that file.

    python benchmarks/learning/verifiable.py --trl-python .venv-trl/bin/python --episodes 384 --seeds 0,1,2 \
        [--sides trl,ppo_critic,ppo_shared,grpo,grpo_exact,rloo] [--out benchmarks/results/verifiable.jsonl]
    python benchmarks/learning/verifiable.py --table [--out ...]
A reasoning-gym task: `--problems reasoning_gym:TASK` (`--size` rows, 480, made once with seed 1234 as lmppo's
`data.prompts: reasoning_gym:TASK` makes them, `--task-options JSON`, `--task-instruction TEXT`), scored on every side
and by the evaluator with `lmppo.rewards.builtin:reasoning_gym` (the task's own `score_answer`, `heldout_score` in the
rows); TRL's worker reads reasoning-gym from lmppo's venv (`--lmppo-python`'s packages, after its own). TRL 1.16:
`--trl-version 1.16` (its venv `.venv-trl116`, or `--trl-python`); the rows record TRL's version.
Another task: `--problems my_task.jsonl` (one {"prompt": ..., "solution": ...} per line, scored by `exact_match`),
`--heldout N` (100), `--max-new-tokens` (16), `--max-prompt-length` (48 tokens with the chat template; lmppo is told to
stop on a longer prompt rather than cut it, as TRL cuts none). Each row records its task; `--table` prints one table
per task.
Worker modes (used by the driver): --worker lmppo|trl --cfg run.json ; --evaluate run.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))
import bench_path  # noqa: E402, F401  (every benchmark folder on the path)
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
    model_dir,
    nested,
    read_rows,
    run_child,
    save_merged,
    spread,
    trl_grpo_arguments,
    trl_model,
    trl_python,
    worker_env,
)

HELDOUT = 100
BATCH, GROUP = 32, 8
SETTINGS = dict(lr=7e-4, max_new_tokens=16, temperature=0.7, lora_r=16, lora_alpha=32)  # max_new_tokens: the default
REASONING_GYM = "reasoning_gym:"
RG_ROWS_SEED = 1234
"""reasoning-gym rows are made once with this seed (the same rows for every side and seed), then split as a file's."""
REWARDS = {"exact_match": "lmppo.rewards.builtin:exact_match", "reasoning_gym": "lmppo.rewards.builtin:reasoning_gym"}

# lmppo sides: overrides on the shared settings; `grpo_exact`'s rows in docs/choosing.md were run as `--sides grpo
# --extra '{"kl.estimator": "exact", "kl.placement": "loss"}'`, the same config
LMPPO_SIDES = lmppo_sides(GROUP)
SIDES = ["trl", *LMPPO_SIDES]
METRIC = {"exact_match": "heldout_exact_match", "reasoning_gym": "heldout_score"}
"""A row's held-out figure by the task's reward."""
SHOWN = {"trl": "TRL GRPOTrainer", **{side: f"lmppo `{side}`" for side in LMPPO_SIDES}}  # names in the table


def reward_of(source: str) -> str:
    """The reward of a task, on every side: the task's own `score_answer` for reasoning-gym, else `exact_match`."""
    return "reasoning_gym" if source.startswith(REASONING_GYM) else "exact_match"


def load_problems(source: str, task: dict | None = None) -> list[dict]:
    """The task's problems: `builtin:arithmetic`, `reasoning_gym:TASK` (`task`: its `size`, `options` and
    `instruction`; rows made with seed RG_ROWS_SEED, each with its `entry` and `task` for the reward), or a .jsonl
    file of objects with a non-empty `prompt` (text) and a `solution` (text or number, compared by `exact_match`).
    Exits with one `error:` line naming the file, the line and what is wrong, before any model is loaded."""
    if source == "builtin:arithmetic":
        sys.path.insert(0, str(REPO / "src"))
        from lmppo.models.assets import arithmetic_problems

        return [{"prompt": p["prompt"], "solution": p["solution"]} for p in arithmetic_problems()]
    if source.startswith(REASONING_GYM):
        return reasoning_gym_problems(source, task or {})
    path = Path(source)
    if not path.is_file():
        sys.exit(
            f"error: --problems {source!r} is not a file; give builtin:arithmetic, reasoning_gym:TASK or a .jsonl file"
        )
    problems = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            sys.exit(f"error: --problems {source} line {number}: not JSON ({e.msg})")
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            sys.exit(f"error: --problems {source} line {number}: needs a non-empty text `prompt`")
        solution = row.get("solution")
        if isinstance(solution, bool) or not isinstance(solution, (str, int, float)) or str(solution).strip() == "":
            sys.exit(f"error: --problems {source} line {number}: needs a `solution` (text or number), got {solution!r}")
        problems.append({"prompt": row["prompt"], "solution": str(solution)})
    return problems


def reasoning_gym_problems(source: str, task: dict) -> list[dict]:
    """The rows of `reasoning_gym:TASK` as lmppo's `data.prompts: reasoning_gym:TASK` makes them (`solution`: the
    task's answer); a task or option reasoning-gym refuses is lmppo's one line."""
    sys.path.insert(0, str(REPO / "src"))
    from lmppo.data.generated import reasoning_gym_records
    from lmppo.errors import LmppoError

    try:
        rows = reasoning_gym_records(
            source[len(REASONING_GYM) :], task["size"], RG_ROWS_SEED, task["options"], task["instruction"]
        )
    except LmppoError as err:
        sys.exit(f"error: --problems {source}: {err}")
    return [{"prompt": r["prompt"], "solution": r["answer"], "entry": r["entry"], "task": r["task"]} for r in rows]


def split_problems(work: Path, source: str, heldout_count: int, task: dict | None = None) -> tuple[Path, list[dict]]:
    """train.jsonl (prompt, solution and the task's other columns) in `work`, and the held-out problems (fixed split,
    seed 1234)."""
    problems = load_problems(source, task)
    if not 1 <= heldout_count <= len(problems) - BATCH // GROUP:
        sys.exit(
            f"error: --heldout {heldout_count} with {len(problems)} problems in {source}; allowed: 1 to "
            f"{len(problems) - BATCH // GROUP} (one rollout's {BATCH // GROUP} prompts must stay for training)"
        )
    order = list(range(len(problems)))
    random.Random(1234).shuffle(order)
    heldout = [problems[i] for i in order[:heldout_count]]
    train = [problems[i] for i in order[heldout_count:]]
    path = work / "train.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in train))
    return path, heldout


# ------------------------------------------------------------------------------------------------ workers
def lmppo_worker(cfg: dict) -> None:
    import torch

    torch.set_num_threads(1)
    from lmppo import Config, PPOTrainer
    from lmppo.config.fields import from_dict

    overrides = {
        "output_dir": cfg["run_dir"],
        "seed": cfg["seed"],
        "total_episodes": cfg["episodes"],
        "precision": "fp32",
        "model.policy": cfg["model_dir"],
        "model.lora.enabled": True,
        "model.lora.r": SETTINGS["lora_r"],
        "model.lora.alpha": SETTINGS["lora_alpha"],
        "model.lora.target_modules": ["all-linear"],
        "data.prompts": cfg["train_file"],
        "data.chat_template": True,
        "data.max_prompt_length": cfg["max_prompt_length"],
        "data.long_prompts": "error",  # TRL does not cut prompts: neither side may
        "data.holdout": 0,
        "rollout.batch_size": BATCH,
        "rollout.max_new_tokens": cfg["max_new_tokens"],
        "rollout.temperature": SETTINGS["temperature"],
        "reward.sources": [{"kind": "function", "path": REWARDS[cfg["reward"]], "name": cfg["reward"], "weight": 1.0}],
        "reward.truncation": "none",
        "kl.coef": 0.05,
        "kl.controller": "pi",
        "kl.target": 5.0,
        "ppo.micro_batch_size": 16,
        "ppo.learning_rate": SETTINGS["lr"],
        "ppo.lr_schedule": "constant",
        "log.trackers": [],
        "log.progress": False,
        "log.sample_every": 0,
        **LMPPO_SIDES[cfg["side"]],
        **cfg.get("extra", {}),
    }
    config = from_dict(Config, nested(lmppo_steps(overrides)))
    trainer = PPOTrainer(config)
    history = trainer.train()
    merged = trainer.policy.merge_and_unload() if hasattr(trainer.policy, "merge_and_unload") else trainer.policy
    merged.save_pretrained(cfg["policy_dir"])
    trainer.tokenizer.save_pretrained(cfg["policy_dir"])
    skipped = sum(m.get("update/skipped_no_signal", 0.0) for m in history)
    Path(cfg["result"]).write_text(json.dumps({"iterations": len(history), "skipped_no_signal": skipped}))


def trl_worker(cfg: dict) -> None:
    import torch

    torch.set_num_threads(1)
    from datasets import Dataset

    import trl
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(REPO / "src"))
    sys.path.append(cfg["libraries"])  # reasoning-gym from lmppo's venv, after TRL's own packages
    score = task_reward(cfg["reward"])
    rows = [json.loads(line) for line in Path(cfg["train_file"]).read_text().splitlines()]
    # columns as JSON text: an Arrow column cannot hold reasoning-gym items whose metadata differ in shape
    data = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["prompt"]}], **{k: json.dumps(v) for k, v in r.items()}}
            for r in rows
        ]
    )

    def task_reward_function(completions, **columns):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return score(texts, **{k: [json.loads(v) for v in vs] for k, vs in columns.items() if k in rows[0]})

    arguments = trl_grpo_arguments(
        run_dir=cfg["run_dir"],
        seed=cfg["seed"],
        episodes=cfg["episodes"],
        batch=BATCH,
        group=GROUP,
        max_new_tokens=cfg["max_new_tokens"],
        settings=SETTINGS,
    )
    args = GRPOConfig(**arguments)
    tokenizer, model, lora = trl_model(cfg["model_dir"], SETTINGS)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=task_reward_function,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=lora,
    )
    trainer.train()
    save_merged(trainer, tokenizer, cfg["policy_dir"])
    Path(cfg["result"]).write_text(json.dumps({"steps": arguments["max_steps"], "trl_version": trl.__version__}))


def task_reward(name: str):
    """The reward function of the task's reward (`REWARDS`), from lmppo's source tree."""
    from lmppo.rewards.builtin import exact_match
    from lmppo.rewards.tasks import reasoning_gym

    return {"exact_match": exact_match, "reasoning_gym": reasoning_gym}[name]


# ------------------------------------------------------------------------------------------------ evaluation
def evaluate(cfg: dict) -> dict:
    """Greedy held-out exact match (reasoning-gym: the task's score) of `cfg['policy_dir']`, and its KL to the base
    on the held-out prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(REPO / "src"))
    from lmppo.core.kl import exact_kl

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(cfg["model_dir"])
    tokenizer.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(cfg["policy_dir"], dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(cfg["model_dir"], dtype=torch.float32).eval()
    heldout = cfg["heldout"]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        for p in heldout
    ]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    P = enc.input_ids.shape[1]
    with torch.no_grad():
        greedy = policy.generate(
            **enc, max_new_tokens=cfg["max_new_tokens"], do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        answers = tokenizer.batch_decode(greedy[:, P:], skip_special_tokens=True)
        columns = {k: [p[k] for p in heldout] for k in heldout[0] if k != "prompt"}
        score = task_reward(cfg["reward"])(answers, **columns)
        torch.manual_seed(0)
        kls = []
        for _ in range(2):
            sampled = policy.generate(
                **enc,
                max_new_tokens=cfg["max_new_tokens"],
                do_sample=True,
                temperature=SETTINGS["temperature"],
                top_k=0,
                top_p=1.0,
                pad_token_id=tokenizer.pad_token_id,
            )
            attention = torch.cat([enc.attention_mask, torch.ones_like(sampled[:, P:])], dim=1)
            response = sampled[:, P:]
            real = torch.cumsum((response == tokenizer.eos_token_id).long(), dim=1)
            real = (real - (response == tokenizer.eos_token_id).long()) == 0  # up to and including the first eos
            logits = policy(sampled, attention_mask=attention).logits[:, P - 1 : -1] / SETTINGS["temperature"]
            ref_logits = base(sampled, attention_mask=attention).logits[:, P - 1 : -1] / SETTINGS["temperature"]
            kl = exact_kl(logits, ref_logits)  # (B, T)
            kls.append(float((kl * real).sum(1).mean()))
    return {METRIC[cfg["reward"]]: sum(score) / len(score), "heldout_kl": statistics.mean(kls)}


# ------------------------------------------------------------------------------------------------ driver
def child(python: str, args: list[str], log: Path, env: dict) -> tuple[int, float]:
    return run_child([python, __file__, *args], log, env)


def task_work(work: Path, problems: str) -> Path:
    """The task's own folder under `--work`: two tasks in one --work share run names (grpo_exact-128-s1), and lmppo
    refuses a folder that holds a run (a second task's run failed so) while TRL writes over the first task's model."""
    return work / re.sub(r"[^A-Za-z0-9._-]+", "_", problems)


def drive(a: argparse.Namespace) -> None:
    work = task_work(Path(a.work or tempfile.mkdtemp(prefix="verifiable-")), a.problems)
    work.mkdir(parents=True, exist_ok=True)
    rg_task = {"size": a.size, "options": a.task_options, "instruction": a.task_instruction}
    train_file, heldout = split_problems(work, a.problems, a.heldout, rg_task)
    model = model_dir(a.lmppo_python)
    env = worker_env()
    env_trl = worker_env(PYTHONPATH=str(REPO / "src"))
    out = Path(a.out)
    task = {
        "max_new_tokens": a.max_new_tokens,
        "max_prompt_length": a.max_prompt_length,
        "reward": reward_of(a.problems),
    }
    base_cfg = {"model_dir": model, "policy_dir": model, "heldout": heldout, **task}
    base_file = work / "base.json"
    base_file.write_text(json.dumps(base_cfg))
    at = commit()
    if not a.skip_base:
        rc, _ = child(
            a.lmppo_python,
            ["--evaluate", str(base_file), "--result", str(work / "base_eval.json")],
            work / "base.log",
            env,
        )
        base = json.loads((work / "base_eval.json").read_text())
        append_row(out, {"side": "base", "task": a.problems, "episodes": 0, "seed": None, "commit": at, **base})
    trl = trl_python(a.trl_python, a.trl_version)
    for seed in a.seeds:
        for side in a.sides:
            tag = f"{side}-{a.episodes}-s{seed}{a.tag}"
            cfg = {
                "side": side,
                "seed": seed,
                "episodes": a.episodes,
                "model_dir": model,
                "train_file": str(train_file),
                "run_dir": str(work / tag),
                "policy_dir": str(work / tag / "merged"),
                "result": str(work / f"{tag}.result.json"),
                "heldout": heldout,
                "libraries": libraries(a.lmppo_python) if side == "trl" else "",
                **task,
                "extra": a.extra if side != "trl" else {},
            }
            cfg_file = work / f"{tag}.json"
            cfg_file.write_text(json.dumps(cfg))
            started = time.time()
            rc, cpu = child(
                trl if side == "trl" else a.lmppo_python,
                ["--worker", "trl" if side == "trl" else "lmppo", "--cfg", str(cfg_file)],
                work / f"{tag}.log",
                env_trl if side == "trl" else env,
            )
            wall = time.time() - started
            if rc != 0:
                print(f"{tag}: worker failed (exit {rc}), log {work / f'{tag}.log'}", flush=True)
                continue
            eval_file = work / f"{tag}.eval.json"
            rc, _ = child(
                a.lmppo_python, ["--evaluate", str(cfg_file), "--result", str(eval_file)], work / f"{tag}.eval.log", env
            )
            if rc != 0:
                print(f"{tag}: evaluation failed (exit {rc})", flush=True)
                continue
            row = {
                "side": side,
                "task": a.problems,
                "episodes": a.episodes,
                "seed": seed,
                "tag": a.tag,
                "extra": cfg["extra"],
                "commit": at,
                **json.loads(eval_file.read_text()),
                **json.loads(Path(cfg["result"]).read_text()),
                "cpu_s": round(cpu, 1),
                "wall_s": round(wall, 1),
            }
            append_row(out, row)


def table(path: Path) -> str:
    """One markdown table per task of the rows in `path` (rows without a task are `builtin:arithmetic`'s)."""
    tasks = by_task(read_rows(path), "builtin:arithmetic")
    return "\n\n".join(task_table(task, rs, several=len(tasks) > 1) for task, rs in tasks.items())


def task_table(task: str, rows: list[dict], several: bool) -> str:
    metric = "heldout_score" if any("heldout_score" in r for r in rows) else "heldout_exact_match"
    shown = "score (the task's score_answer)" if metric == "heldout_score" else "exact match"
    base = [r for r in rows if r["side"] == "base"]
    lines = [f"Task {task}\n"] if several else []
    if base:
        lines.append(f"Base model (before): held-out {shown} {base[-1][metric]:.2f}\n")
    lines.append(
        f"| side | completions | seeds | held-out {shown} (mean, min-max) | held-out KL to base (nats) | CPU s |"
    )
    lines.append("|---|---|---|---|---|---|")
    for (side, episodes), rs in by_side([r for r in rows if r["side"] != "base"], SHOWN):
        cpu = statistics.mean(r["cpu_s"] for r in rs)
        lines.append(
            f"| {side} | {episodes} | {len(rs)} | {spread([r[metric] for r in rs])} | "
            f"{spread([r['heldout_kl'] for r in rs])} | {cpu:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=["lmppo", "trl"])
    p.add_argument("--cfg")
    p.add_argument("--evaluate")
    p.add_argument("--result")
    p.add_argument("--table", action="store_true")
    add_trl_options(p, "1.12")
    p.add_argument("--sides", type=lambda s: s.split(","), default=SIDES)
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--episodes", type=int, default=384)
    p.add_argument(
        "--problems",
        default="builtin:arithmetic",
        help="the task: builtin:arithmetic, reasoning_gym:TASK (scored by the task's score_answer) or a .jsonl of "
        "{prompt, solution} (checked with exact_match)",
    )
    p.add_argument("--size", type=int, default=480, help="rows made of reasoning_gym:TASK (held-out ones included)")
    p.add_argument("--task-options", type=json_object, default={}, help="JSON: reasoning_gym:TASK's options")
    p.add_argument("--task-instruction", default="", help="text after each reasoning-gym question")
    p.add_argument("--heldout", type=int, default=HELDOUT, help="problems kept out of training and scored")
    p.add_argument("--max-new-tokens", type=int, default=SETTINGS["max_new_tokens"])
    p.add_argument(
        "--max-prompt-length", type=int, default=48, help="tokens, chat template included; a longer prompt is an error"
    )
    p.add_argument("--extra", type=json_object, default={}, help="JSON dict of config overrides for the lmppo sides")
    p.add_argument("--tag", default="", help="suffix of the side's name in the table (a variant)")
    p.add_argument("--work", default="")
    p.add_argument("--skip-base", action="store_true")
    p.add_argument("--out", default=str(REPO / "benchmarks/results/verifiable.jsonl"))
    a = p.parse_args()
    if a.worker:
        cfg = json.loads(Path(a.cfg).read_text())
        (lmppo_worker if a.worker == "lmppo" else trl_worker)(cfg)
    elif a.evaluate:
        Path(a.result).write_text(json.dumps(evaluate(json.loads(Path(a.evaluate).read_text()))))
    elif a.table:
        print(table(Path(a.out)))
    else:
        check_positive(a, ("episodes", "max_new_tokens", "max_prompt_length", "size"))
        check_sides(a.sides, SIDES)
        drive(a)


if __name__ == "__main__":
    main()
