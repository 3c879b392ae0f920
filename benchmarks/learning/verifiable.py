"""Side by side on a verifiable reward: lmppo (PPO with a critic, PPO with a shared value head, `grpo`, `grpo_exact`,
`rloo`) and TRL 1.12's GRPOTrainer (in its own venv, as `make bench` runs TRL), SmolLM2-135M-Instruct learning
small arithmetic.

Task: `builtin:arithmetic` (480 problems: sums, differences, products, "Answer with the number only."), split once
by a fixed seed into 380 training problems and 100 held-out ones, prompts through the chat template. Reward: lmppo's
`lmppo.rewards.builtin:exact_match` (1 if the final number equals the solution), on both sides.

Equal on every side: LoRA r16 / alpha 32 / all-linear / no dropout, fp32, 1 thread, 16 new tokens at temperature
0.7, AdamW at a constant 7e-4 (eps 1e-5, grad-norm clip 1.0), 32 completions per rollout and 4 optimizer steps of
16 completions on each rollout (2 epochs x 2 minibatches; TRL: steps_per_generation 2, num_iterations 2), the same
completions in all (`--episodes`). Group sides (lmppo grpo/rloo, TRL) sample 8 completions per prompt; ratio clip
0.2, top_k 0 / top_p 1 on both. Everything else is each side's default: TRL 1.12's GRPOTrainer `beta 0` (no KL
term), `loss_type dapo` (token sum over the generation batch's token count: a token mean, as lmppo's),
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
Another task: `--problems my_task.jsonl` (one {"prompt": ..., "solution": ...} per line, scored by `exact_match`),
`--heldout N` (100), `--max-new-tokens` (16), `--max-prompt-length` (48 tokens with the chat template; lmppo is told to
stop on a longer prompt rather than cut it, as TRL cuts none). Each row records its task; `--table` prints one table
per task.
Worker modes (used by the driver): --worker lmppo|trl --cfg run.json ; --evaluate run.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HELDOUT = 100
BATCH, STEPS_PER_ROLLOUT, GROUP = 32, 4, 8
SETTINGS = dict(lr=7e-4, max_new_tokens=16, temperature=0.7, lora_r=16, lora_alpha=32)  # max_new_tokens: the default

# lmppo sides: overrides on the shared settings (what each knob is: docs/choosing.md)
# critic-free: the value head is not trained (vf_coef 0), or its loss would move the shared trunk for nothing
GRPO = {"ppo.advantage_estimator": "grpo", "rollout.num_samples_per_prompt": GROUP, "ppo.vf_coef": 0.0}
LMPPO_SIDES: dict[str, dict] = {
    "ppo_critic": {"value.mode": "critic"},
    "ppo_shared": {"value.mode": "shared"},
    "grpo": GRPO,
    # what docs/choosing.md recommends for verifiable rewards: the exact KL as a loss term, not in the rewards (its
    # rows were run as `--sides grpo --extra '{"kl.estimator": "exact", "kl.placement": "loss"}'`, the same config)
    "grpo_exact": {**GRPO, "kl.estimator": "exact", "kl.placement": "loss"},
    "rloo": {**GRPO, "ppo.advantage_estimator": "rloo"},
}
SIDES = ["trl", *LMPPO_SIDES]
SHOWN = {"trl": "TRL GRPOTrainer", **{side: f"lmppo `{side}`" for side in LMPPO_SIDES}}  # names in the table


def load_problems(source: str) -> list[dict]:
    """The task's problems: `builtin:arithmetic`, or a .jsonl file of objects with a non-empty `prompt` (text) and a
    `solution` (text or number, compared by `exact_match`). Exits with one `error:` line naming the file, the line
    and what is wrong, before any model is loaded."""
    if source == "builtin:arithmetic":
        sys.path.insert(0, str(REPO / "src"))
        from lmppo.models.assets import arithmetic_problems

        return [{"prompt": p["prompt"], "solution": p["solution"]} for p in arithmetic_problems()]
    path = Path(source)
    if not path.is_file():
        sys.exit(f"error: --problems {source!r} is not a file; give builtin:arithmetic or a .jsonl file")
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


def split_problems(work: Path, source: str, heldout_count: int) -> tuple[Path, list[dict]]:
    """train.jsonl (prompt, solution) in `work`, and the held-out problems (fixed split, seed 1234)."""
    problems = load_problems(source)
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
    path.write_text("".join(json.dumps({"prompt": p["prompt"], "solution": p["solution"]}) + "\n" for p in train))
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
        "reward.sources": [
            {"kind": "function", "path": "lmppo.rewards.builtin:exact_match", "name": "exact_match", "weight": 1.0}
        ],
        "reward.truncation": "none",
        "kl.coef": 0.05,
        "kl.controller": "pi",
        "kl.target": 5.0,
        "ppo.num_epochs": 2,
        "ppo.num_minibatches": 2,
        "ppo.micro_batch_size": 16,
        "ppo.learning_rate": SETTINGS["lr"],
        "ppo.lr_schedule": "constant",
        "log.trackers": [],
        "log.progress": False,
        "log.sample_every": 0,
        **LMPPO_SIDES[cfg["side"]],
        **cfg.get("extra", {}),
    }
    config = from_dict(Config, nested(overrides))
    trainer = PPOTrainer(config)
    history = trainer.train()
    merged = trainer.policy.merge_and_unload() if hasattr(trainer.policy, "merge_and_unload") else trainer.policy
    merged.save_pretrained(cfg["policy_dir"])
    trainer.tokenizer.save_pretrained(cfg["policy_dir"])
    skipped = sum(m.get("update/skipped_no_signal", 0.0) for m in history)
    Path(cfg["result"]).write_text(json.dumps({"iterations": len(history), "skipped_no_signal": skipped}))


def nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def trl_worker(cfg: dict) -> None:
    import torch

    torch.set_num_threads(1)
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(REPO / "src"))
    from lmppo.rewards.builtin import exact_match

    rows = [json.loads(line) for line in Path(cfg["train_file"]).read_text().splitlines()]
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "solution": r["solution"]} for r in rows]
    )

    def exact_match_reward(completions, solution, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return exact_match(texts, solution)

    steps = cfg["episodes"] // BATCH * STEPS_PER_ROLLOUT
    args = GRPOConfig(
        output_dir=cfg["run_dir"],
        use_cpu=True,
        bf16=False,
        seed=cfg["seed"],
        per_device_train_batch_size=BATCH // 2,
        gradient_accumulation_steps=1,
        steps_per_generation=2,
        num_iterations=2,
        num_generations=GROUP,
        max_completion_length=cfg["max_new_tokens"],
        temperature=SETTINGS["temperature"],
        learning_rate=SETTINGS["lr"],
        lr_scheduler_type="constant",
        adam_epsilon=1e-5,
        max_grad_norm=1.0,
        max_steps=steps,
        gradient_checkpointing=False,
        logging_steps=STEPS_PER_ROLLOUT,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(cfg["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model_dir"], dtype=torch.float32)
    lora = LoraConfig(
        r=SETTINGS["lora_r"],
        lora_alpha=SETTINGS["lora_alpha"],
        target_modules="all-linear",
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_match_reward,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=lora,
    )
    trainer.train()
    merged = trainer.model.merge_and_unload()
    merged.save_pretrained(cfg["policy_dir"])
    tokenizer.save_pretrained(cfg["policy_dir"])
    Path(cfg["result"]).write_text(json.dumps({"steps": steps}))


# ------------------------------------------------------------------------------------------------ evaluation
def evaluate(cfg: dict) -> dict:
    """Greedy held-out exact match of `cfg['policy_dir']`, and its KL to the base on the held-out prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(REPO / "src"))
    from lmppo.core.kl import exact_kl
    from lmppo.rewards.builtin import exact_match

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
        score = exact_match(answers, [p["solution"] for p in heldout])
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
    return {"heldout_exact_match": sum(score) / len(score), "heldout_kl": statistics.mean(kls)}


# ------------------------------------------------------------------------------------------------ driver
def run_child(python: str, args: list[str], log: Path, env: dict | None = None) -> tuple[int, float]:
    """Run a worker; (exit code, CPU seconds of the child: user + system)."""
    with open(log, "w") as out:
        proc = subprocess.Popen([python, __file__, *args], stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime


def model_dir(python: str) -> str:
    code = "from lmppo.models.assets import ensure_smollm2; print(ensure_smollm2())"
    return subprocess.check_output([python, "-c", code], text=True).strip().splitlines()[-1]


def drive(a: argparse.Namespace) -> None:
    work = Path(a.work or tempfile.mkdtemp(prefix="verifiable-"))
    work.mkdir(parents=True, exist_ok=True)
    train_file, heldout = split_problems(work, a.problems, a.heldout)
    model = model_dir(a.lmppo_python)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env_trl = dict(env, PYTHONPATH=str(REPO / "src"))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    task = {"max_new_tokens": a.max_new_tokens, "max_prompt_length": a.max_prompt_length}
    base_cfg = {"model_dir": model, "policy_dir": model, "heldout": heldout, **task}
    base_file = work / "base.json"
    base_file.write_text(json.dumps(base_cfg))
    if not a.skip_base:
        rc, _ = run_child(
            a.lmppo_python,
            ["--evaluate", str(base_file), "--result", str(work / "base_eval.json")],
            work / "base.log",
            env,
        )
        base = json.loads((work / "base_eval.json").read_text())
        print(f"base: held-out exact match {base['heldout_exact_match']:.2f}", flush=True)
        with open(out, "a") as f:
            f.write(json.dumps({"side": "base", "task": a.problems, "episodes": 0, "seed": None, **base}) + "\n")
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
                **task,
                "extra": json.loads(a.extra) if a.extra and side != "trl" else {},
            }
            cfg_file = work / f"{tag}.json"
            cfg_file.write_text(json.dumps(cfg))
            python = a.trl_python if side == "trl" else a.lmppo_python
            started = time.time()
            rc, cpu = run_child(
                python,
                ["--worker", "trl" if side == "trl" else "lmppo", "--cfg", str(cfg_file)],
                work / f"{tag}.log",
                env_trl if side == "trl" else env,
            )
            wall = time.time() - started
            if rc != 0:
                print(f"{tag}: worker failed (exit {rc}), log {work / f'{tag}.log'}", flush=True)
                continue
            eval_file = work / f"{tag}.eval.json"
            rc, _ = run_child(
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
                **json.loads(eval_file.read_text()),
                **json.loads(Path(cfg["result"]).read_text()),
                "cpu_s": round(cpu, 1),
                "wall_s": round(wall, 1),
            }
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


def table(path: Path) -> str:
    """One markdown table per task of the rows in `path` (rows without a task are `builtin:arithmetic`'s)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    tasks: dict[str, list[dict]] = {}
    for r in rows:
        tasks.setdefault(r.get("task", "builtin:arithmetic"), []).append(r)
    return "\n\n".join(task_table(task, rs, several=len(tasks) > 1) for task, rs in tasks.items())


def label(row: dict) -> str:
    """A row's side as the table names it: the side, then its config overrides (`--extra`) if any, else its tag."""
    side = SHOWN.get(row["side"], row["side"])
    extra = row.get("extra") or {}
    if extra:
        return f"{side} + " + ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in extra.items())
    return f"{side} {row['tag']}" if row.get("tag") else side


def task_table(task: str, rows: list[dict], several: bool) -> str:
    base = [r for r in rows if r["side"] == "base"]
    lines = [f"Task {task}\n"] if several else []
    if base:
        lines.append(f"Base model (before): held-out exact match {base[-1]['heldout_exact_match']:.2f}\n")
    lines.append(
        "| side | completions | seeds | held-out exact match (mean, min-max) | held-out KL to base (nats) | CPU s |"
    )
    lines.append("|---|---|---|---|---|---|")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["side"] != "base":
            groups.setdefault((label(r), r["episodes"]), []).append(r)
    for (side, episodes), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        em = [r["heldout_exact_match"] for r in rs]
        kl = [r["heldout_kl"] for r in rs]
        cpu = [r["cpu_s"] for r in rs]
        lines.append(
            f"| {side} | {episodes} | {len(rs)} | {statistics.mean(em):.2f} ({min(em):.2f}-{max(em):.2f}) | "
            f"{statistics.mean(kl):.2f} ({min(kl):.2f}-{max(kl):.2f}) | {statistics.mean(cpu):.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=["lmppo", "trl"])
    p.add_argument("--cfg")
    p.add_argument("--evaluate")
    p.add_argument("--result")
    p.add_argument("--table", action="store_true")
    p.add_argument("--trl-python", default=str(REPO / ".venv-trl/bin/python"))
    p.add_argument("--lmppo-python", default=sys.executable)
    p.add_argument("--sides", type=lambda s: s.split(","), default=SIDES)
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--episodes", type=int, default=384)
    p.add_argument(
        "--problems",
        default="builtin:arithmetic",
        help="the task: builtin:arithmetic or a .jsonl of {prompt, solution} (checked with exact_match)",
    )
    p.add_argument("--heldout", type=int, default=HELDOUT, help="problems kept out of training and scored")
    p.add_argument("--max-new-tokens", type=int, default=SETTINGS["max_new_tokens"])
    p.add_argument(
        "--max-prompt-length", type=int, default=48, help="tokens, chat template included; a longer prompt is an error"
    )
    p.add_argument("--extra", default="", help="JSON dict of config overrides for the lmppo sides")
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
        for name in ("episodes", "max_new_tokens", "max_prompt_length"):
            if getattr(a, name) < 1:
                sys.exit(f"error: --{name.replace('_', '-')} {getattr(a, name)}; allowed: a positive whole number")
        unknown = set(a.sides) - set(SIDES)
        if unknown:
            sys.exit(f"error: --sides {sorted(unknown)} unknown; allowed: {', '.join(SIDES)}")
        drive(a)


if __name__ == "__main__":
    main()
