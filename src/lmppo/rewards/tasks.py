"""Rewards that score with a task library's own checker: reasoning-gym's `score_answer` (`reasoning_gym`)."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Optional, Protocol

from lmppo.errors import RewardError
from lmppo.models.extras import environments_library


class ReasoningGymTask(Protocol):
    """What the reward uses of a reasoning-gym dataset."""

    def score_answer(self, answer: Optional[str], entry: dict[str, object]) -> float: ...


def reasoning_gym(
    completions: list[str], entry: list[object], task: Optional[list[object]] = None, **kwargs: object
) -> list[float]:
    """Each completion scored by its reasoning-gym task's own `score_answer(answer, entry)`, in [0, 1] (many tasks
    give partial credit). The answer is the text inside the completion's last `<answer>...</answer>` when it has one
    (reasoning-gym's convention), else the whole completion, stripped.

    Called by keyword: `entry` is the column of that name (the task's item: question, answer, metadata), `task`
    ({"name", "options"}) the task it came from, as `data.prompts: reasoning_gym:TASK` makes them; without `task`
    the entry's `metadata.source_dataset` names the task, built with its default options."""
    if len(entry) != len(completions):
        raise RewardError(f"reasoning_gym: {len(completions)} completions but {len(entry)} entries")
    tasks = task if task is not None else [None] * len(completions)
    rg_utils = environments_library("reasoning_gym.utils", "the reward `reasoning_gym`")
    out = []
    for i, (completion, item, spec) in enumerate(zip(completions, entry, tasks)):
        if not isinstance(item, dict):
            raise RewardError(
                f"reasoning_gym: response {i}'s `entry` is {type(item).__name__}, not a reasoning-gym item"
            )
        name, options = _task_of(item, spec, i)
        tagged = rg_utils.extract_answer(completion)
        answer = tagged if tagged is not None else completion.strip()
        out.append(float(_dataset(name, json.dumps(options, sort_keys=True)).score_answer(answer, item)))
    return out


def _task_of(item: dict[str, object], spec: object, i: int) -> tuple[str, dict[str, object]]:
    if isinstance(spec, dict) and isinstance(spec.get("name"), str):
        options = spec.get("options") or {}
        return str(spec["name"]), dict(options) if isinstance(options, dict) else {}
    metadata = item.get("metadata")
    name = metadata.get("source_dataset") if isinstance(metadata, dict) else None
    if not isinstance(name, str):
        raise RewardError(
            f"reasoning_gym: response {i} has no `task` column and its entry no metadata.source_dataset: "
            "cannot tell which task scores it"
        )
    return name, {}


@lru_cache(maxsize=32)
def _dataset(name: str, options_json: str) -> ReasoningGymTask:
    """The task `name` with its options (JSON, hashable for the cache): one small instance per task and options."""
    rg = environments_library("reasoning_gym", "the reward `reasoning_gym`")
    if name not in rg.factory.DATASETS:
        raise RewardError(f"reasoning_gym: `{name}` is not a reasoning-gym task")
    dataset: ReasoningGymTask = rg.create_dataset(name, size=1, seed=0, **json.loads(options_json))
    return dataset
