"""Which files of a run folder lmppo wrote: `overwrite: true` removes those and nothing else.

A run records the names it owns in `OUTPUT_DIR/.lmppo-owned.json` when it starts (the artifacts that did not
exist before it: metrics, samples, checkpoints, final, tensorboard, summary, config). A folder written before
this record existed is recognised by its shape: `checkpoints/` holding only checkpoint folders, `final/` holding
only `policy/` and `value/`, logs beside a config.yaml lmppo wrote. Anything else with one of those names is
foreign: a run never writes into it nor removes it, and the refusal names it.
"""

from __future__ import annotations

import json
import os
import re

import lmppo.run.storage as storage

OWNED = ".lmppo-owned.json"
ARTIFACTS = ("metrics.jsonl", "samples.jsonl", "checkpoints", "final", "tensorboard", "summary.json", "config.yaml")
"""Names a run writes at the top of its output_dir (besides the lock file and this record)."""
CONFIG_FIRST_LINE = "# lmppo run config (secrets masked); resume with: lmppo train --resume OUTPUT_DIR\n"
_CHECKPOINT_ENTRY = re.compile(r"^(iter-\d+|\.iter-\d+\..*|corrupt-iter-\d+-\w+)$")


def _is_own_config(path: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.readline() == CONFIG_FIRST_LINE
    except OSError:
        return False


def recorded(output_dir: str) -> set[str] | None:
    """Names in the ownership record, None when there is no readable record."""
    try:
        with open(os.path.join(output_dir, OWNED), encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    names = data.get("files") if isinstance(data, dict) else None
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else None


def _looks_own(output_dir: str, name: str) -> bool:
    """For a folder without a record: does `name` have the shape of what lmppo writes?"""
    path = os.path.join(output_dir, name)
    own_config = _is_own_config(os.path.join(output_dir, "config.yaml"))
    try:
        if name == "checkpoints":
            return os.path.isdir(path) and all(_CHECKPOINT_ENTRY.match(e) for e in os.listdir(path))
        if name == "final":
            entries = set(os.listdir(path)) if os.path.isdir(path) else None
            return entries is not None and entries <= {"policy", "value"}
    except OSError:
        return False
    if name == "config.yaml":
        return own_config
    return own_config


def survey(output_dir: str) -> tuple[list[str], list[str]]:
    """(lmppo's own, foreign) names among the run artifacts present in `output_dir`. An own config.yaml alone
    (a run that stopped before writing anything else) is not listed."""
    present = [n for n in ARTIFACTS if os.path.lexists(os.path.join(output_dir, n))]
    mine = recorded(output_dir)
    own, foreign = [], []
    for name in present:
        is_own = name in mine if mine is not None else _looks_own(output_dir, name)
        if name == "config.yaml" and not is_own and _is_own_config(os.path.join(output_dir, name)):
            is_own = True  # lmppo's header: written by some lmppo run
        (own if is_own else foreign).append(name)
    if own == ["config.yaml"]:
        own = []
    return own, foreign


def claim(output_dir: str) -> None:
    """Record the artifact names that are free (or already ours) as this run's."""
    mine = recorded(output_dir) or set()
    names = sorted(
        n
        for n in ARTIFACTS
        if n in mine
        or not os.path.lexists(os.path.join(output_dir, n))
        or (n == "config.yaml" and _is_own_config(os.path.join(output_dir, n)))
    )
    storage.write_json(os.path.join(output_dir, OWNED), {"files": names}, f"the ownership record ({OWNED})", indent=1)


def remove_own(output_dir: str, names: list[str]) -> None:
    """Remove lmppo's own artifacts `names` (each renamed aside first, then deleted)."""
    for name in names:
        path = os.path.join(output_dir, name)
        if name == "config.yaml":
            continue  # replaced by the new run's
        if os.path.isdir(path) and not os.path.islink(path):
            storage.remove_tree(path, name)
        else:
            with storage.writing(f"(removing) {name}", path):
                os.unlink(path)
