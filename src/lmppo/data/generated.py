"""Prompt sets made from the run's seed rather than read from a file: a reasoning-gym task (`reasoning_gym:TASK`)
and the game seeds of TextArena runs (`builtin:textarena`). Each row is a pure function of (seed, index, options),
so the same run makes the same rows: exact resume, and a held-out split that stays out."""

from __future__ import annotations

import difflib
import hashlib
from typing import Mapping

from lmppo.errors import ConfigError
from lmppo.models.extras import environments_library

REASONING_GYM = "reasoning_gym:"
"""`data.prompts: reasoning_gym:TASK`: rows of a reasoning-gym task."""
TEXTARENA_GAMES = "builtin:textarena"
"""`data.prompts: builtin:textarena`: rows that carry only the seed of a TextArena game."""
LIST_TASKS = 'python -c "import reasoning_gym; print(sorted(reasoning_gym.factory.DATASETS))"'
TEXTARENA_PROMPT = "Play the game."
"""The prompt of a `builtin:textarena` row: never shown, the game writes the opening."""


def is_generated(spec: str) -> bool:
    """Whether `data.prompts` names a generated set (no file)."""
    return spec.startswith(REASONING_GYM) or spec == TEXTARENA_GAMES


def generated_records(
    spec: str, size: int, seed: int, options: Mapping[str, object], instruction: str = ""
) -> list[dict[str, object]]:
    """The `size` rows of generated set `spec` for data seed `seed` (`options`: a reasoning-gym task's options,
    `instruction`: text after each of its questions)."""
    if spec == TEXTARENA_GAMES:
        if instruction:
            raise ConfigError("data.task_instruction", instruction, f"applies to `{REASONING_GYM}TASK` only")
        if options:
            raise ConfigError("data.task_options", dict(options), f"apply to `{REASONING_GYM}TASK` only; remove them")
        return [{"prompt": TEXTARENA_PROMPT, "game_seed": game_seed(seed, i)} for i in range(size)]
    return reasoning_gym_records(spec[len(REASONING_GYM) :], size, seed, options, instruction)


def game_seed(seed: int, index: int) -> int:
    """The seed of game `index` of a run seeded `seed`: 31 bits of sha256 (independent across rows and seeds)."""
    digest = hashlib.sha256(f"lmppo-textarena:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1


def reasoning_gym_records(
    task: str, size: int, seed: int, options: Mapping[str, object], instruction: str = ""
) -> list[dict[str, object]]:
    """Rows of reasoning-gym task `task`: `prompt` (the question, then `instruction` after a space when given),
    `answer`, `entry` (the task's item, what its `score_answer` reads) and `task` ({"name", "options"}: how
    `lmppo.rewards.builtin:reasoning_gym` rebuilds the task to score with)."""
    rg = environments_library("reasoning_gym", f"data.prompts `{REASONING_GYM}{task}`")
    datasets: Mapping[str, tuple[type, type]] = rg.factory.DATASETS
    if task not in datasets:
        close = difflib.get_close_matches(task, list(datasets), n=3, cutoff=0.5) or sorted(datasets)[:3]
        raise ConfigError(
            "data.prompts",
            f"{REASONING_GYM}{task}",
            f"`{task}` is not a reasoning-gym task (e.g. {', '.join(close)}; {len(datasets)} in all, listed by: "
            f"{LIST_TASKS})",
        )
    fixed = sorted({"seed", "size"} & set(options))
    if fixed:
        raise ConfigError(
            "data.task_options", dict(options), f"`{fixed[0]}` is set by the run (`seed`, data.size); remove it"
        )
    try:
        dataset = rg.create_dataset(task, size=size, seed=seed, **dict(options))
    except (TypeError, ValueError, AssertionError) as err:
        fields = ", ".join(sorted(getattr(datasets[task][1], "__dataclass_fields__", {})))
        raise ConfigError(
            "data.task_options", dict(options), f"refused by reasoning-gym's `{task}` ({err}); its options: {fields}"
        ) from None
    out: list[dict[str, object]] = []
    for i in range(size):
        entry = dataset[i]
        out.append(
            {
                "prompt": f"{entry['question']} {instruction}" if instruction else str(entry["question"]),
                "answer": str(entry["answer"]),
                "entry": entry,
                "task": {"name": task, "options": dict(options)},
            }
        )
    return out
