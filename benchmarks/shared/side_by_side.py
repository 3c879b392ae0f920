"""What the learning side-by-side harnesses share (`learning/verifiable.py`: one-turn verifiable rewards,
`learning/agents.py`: multi-turn games): lmppo's sides as config overrides, TRL's GRPOTrainer arguments at the same
episodes and optimizer steps, the worker processes (CPU seconds by `os.wait4`), jsonl rows appended as each run ends
(with the commit), and the table's mean (min-max) over seeds.

Standard library only at import time: the drivers import it without torch."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EPOCHS, MINIBATCHES = 2, 2
"""Each rollout is trained on in EPOCHS passes of MINIBATCHES optimizer steps, on every side (TRL: num_iterations
EPOCHS, steps_per_generation MINIBATCHES)."""
TRL_VERSIONS = {"1.12": ".venv-trl", "1.16": ".venv-trl116"}
"""TRL's venv folder in the repository (git-ignored) by version: the default `--trl-python` of `--trl-version`."""


def lmppo_sides(group: int) -> dict[str, dict[str, object]]:
    """lmppo's sides as config overrides (what each knob is: docs/choosing.md); `group`: episodes per prompt of the
    group estimators."""
    # critic-free: the value head is not trained (vf_coef 0), or its loss would move the shared trunk for nothing
    grpo = {"ppo.advantage_estimator": "grpo", "rollout.num_samples_per_prompt": group, "ppo.vf_coef": 0.0}
    return {
        "ppo_critic": {"value.mode": "critic"},
        "ppo_shared": {"value.mode": "shared"},
        "grpo": grpo,
        # what docs/choosing.md recommends for verifiable rewards: the exact KL as a loss term, not in the rewards
        "grpo_exact": {**grpo, "kl.estimator": "exact", "kl.placement": "loss"},
        "rloo": {**grpo, "ppo.advantage_estimator": "rloo"},
    }


def lmppo_steps(overrides: dict[str, object]) -> dict[str, object]:
    """The optimizer steps of every lmppo side: EPOCHS x MINIBATCHES per rollout."""
    return {"ppo.num_epochs": EPOCHS, "ppo.num_minibatches": MINIBATCHES, **overrides}


def optimizer_steps(episodes: int, batch: int) -> int:
    """Optimizer steps of a run of `episodes` episodes in rollouts of `batch`, on any side."""
    return episodes // batch * EPOCHS * MINIBATCHES


def trl_grpo_arguments(
    *, run_dir: str, seed: int, episodes: int, batch: int, group: int, max_new_tokens: int, settings: dict
) -> dict[str, object]:
    """GRPOConfig's arguments for `episodes` completions in generation batches of `batch` (`group` per prompt), each
    batch trained on EPOCHS x MINIBATCHES optimizer steps (as lmppo's sides); the rest as each side's default
    (the harnesses' docstrings)."""
    return dict(
        output_dir=run_dir,
        use_cpu=True,
        bf16=False,
        seed=seed,
        per_device_train_batch_size=batch // MINIBATCHES,
        gradient_accumulation_steps=1,
        steps_per_generation=MINIBATCHES,
        num_iterations=EPOCHS,
        num_generations=group,
        max_completion_length=max_new_tokens,
        temperature=settings["temperature"],
        learning_rate=settings["lr"],
        lr_scheduler_type="constant",
        adam_epsilon=1e-5,
        max_grad_norm=1.0,
        max_steps=optimizer_steps(episodes, batch),
        gradient_checkpointing=False,
        logging_steps=EPOCHS * MINIBATCHES,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )


def trl_model(model_dir: str, settings: dict) -> tuple:
    """(tokenizer, fp32 model, LoRA config) of TRL's side: the same LoRA as lmppo's (r, alpha, all-linear, no
    dropout). In TRL's venv."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(
        r=settings["lora_r"],
        lora_alpha=settings["lora_alpha"],
        target_modules="all-linear",
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    return tokenizer, model, lora


def save_merged(trainer: object, tokenizer: object, policy_dir: str) -> None:
    """TRL's trained policy with its LoRA merged, and the tokenizer, in `policy_dir` (what the evaluators load)."""
    merged = trainer.model.merge_and_unload()  # type: ignore[attr-defined]
    merged.save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)  # type: ignore[attr-defined]


def add_trl_options(p: argparse.ArgumentParser, version: str) -> None:
    """`--trl-version` (default `version`), `--trl-python` and `--lmppo-python`."""
    p.add_argument(
        "--trl-version",
        choices=sorted(TRL_VERSIONS),
        default=version,
        help="TRL's venv: " + ", ".join(f"{v} in {folder}" for v, folder in TRL_VERSIONS.items()),
    )
    p.add_argument("--trl-python", default="", help="TRL's python (default: the venv of --trl-version)")
    p.add_argument("--lmppo-python", default=sys.executable, help="lmppo's python (default: this one)")


def trl_episodes(arguments: dict) -> int:
    """Completions TRL samples with these GRPOConfig arguments: each is trained on `num_iterations` times."""
    per_step = int(arguments["per_device_train_batch_size"]) * int(arguments["gradient_accumulation_steps"])
    return int(arguments["max_steps"]) * per_step // int(arguments["num_iterations"])


def nested(flat: dict) -> dict:
    """{"a.b": 1} -> {"a": {"b": 1}}: dotted overrides as a config's sections."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def merge(base: dict, extra: dict) -> dict:
    """`base` with `extra` merged in section by section (a recipe's YAML with nested overrides)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def run_child(command: list[str], log: Path, env: dict | None = None) -> tuple[int, float]:
    """Run a worker; (exit code, CPU seconds of the child: user + system, loading included)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime


def worker_env(**extra: str) -> dict[str, str]:
    """The workers' environment: one thread, no network."""
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", **extra)


def model_dir(python: str) -> str:
    """SmolLM2-135M-Instruct as a model folder (made once from the GGUF: `lmppo.models.assets.ensure_smollm2`)."""
    code = "from lmppo.models.assets import ensure_smollm2; print(ensure_smollm2())"
    return subprocess.check_output([python, "-c", code], text=True).strip().splitlines()[-1]


def trl_python(given: str, version: str) -> str:
    """`--trl-python`, or the repository's venv of `--trl-version`."""
    return given or str(REPO / TRL_VERSIONS[version] / "bin" / "python")


def libraries(python: str) -> str:
    """Where `python` (lmppo's venv) keeps its packages: TRL's workers read the task libraries (reasoning-gym,
    TextArena) from there, after their own."""
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return subprocess.check_output([python, "-c", code], text=True).strip()


# overrides that change how an update is computed, not what it is: a micro-batch splits the same minibatch for
# gradient accumulation (the loss is divided by the whole minibatch's denominator), a forward chunk batches the same
# no-gradient passes; a row run with only these (to fit in memory) belongs to the cell of the rows without them
SAME_UPDATE = ("ppo.micro_batch_size", "rollout.forward_batch_size")


def label(row: dict, shown: dict[str, str]) -> str:
    """A row's side as a table names it: `shown[side]` (TRL with its version when the row has it), then its config
    overrides (`--extra`) other than `SAME_UPDATE` if any, else its tag (none when its overrides were all
    `SAME_UPDATE`: the tag named those)."""
    side = f"TRL {row['trl_version']} GRPOTrainer" if row.get("trl_version") else shown.get(row["side"], row["side"])
    extra = row.get("extra") or {}
    changed = {k: v for k, v in extra.items() if k not in SAME_UPDATE}
    if changed:
        return f"{side} + " + ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in changed.items())
    return f"{side} {row['tag']}" if row.get("tag") and not extra else side


def by_task(rows: list[dict], default: str = "") -> dict[str, list[dict]]:
    """Rows by their task, in first-seen order (a row without `task` is `default`'s)."""
    tasks: dict[str, list[dict]] = {}
    for r in rows:
        tasks.setdefault(r.get("task", default), []).append(r)
    return tasks


def by_side(rows: list[dict], shown: dict[str, str]) -> list[tuple[tuple[str, int], list[dict]]]:
    """One task's rows as ((label, episodes), the seeds' rows), by episodes then label: a table's lines."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((label(r, shown), r["episodes"]), []).append(r)
    return sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0]))


def check_sides(sides: list[str], allowed: list[str]) -> None:
    """One `error:` line naming the sides of `--sides` that are not `allowed`."""
    unknown = sorted(set(sides) - set(allowed))
    if unknown:
        sys.exit(f"error: --sides {unknown} unknown; allowed: {', '.join(allowed)}")


def commit() -> str:
    """The checkout's commit, `+dirty` when tracked files differ from it ("" outside a git checkout)."""
    try:
        head = subprocess.check_output(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], text=True).strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD"]).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+dirty" if dirty else "")


def append_row(out: Path, row: dict) -> None:
    """One JSON line, appended as soon as a run ends (an interrupted grid keeps what ran); printed too."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def spread(values: list[float], digits: int = 2) -> str:
    """`mean (min-max)` of one cell over seeds."""
    return f"{statistics.mean(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def json_object(text: str) -> dict:
    """A JSON object option (`--extra`, `--task-options`); argparse reports anything else as the option's error."""
    value = json.loads(text) if text else {}
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def check_positive(args: object, names: tuple[str, ...]) -> None:
    """One `error:` line for the first of these whole-number options below 1."""
    for name in names:
        if getattr(args, name) < 1:
            sys.exit(f"error: --{name.replace('_', '-')} {getattr(args, name)}; allowed: a positive whole number")
