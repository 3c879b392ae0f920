"""`lmppo warp [CONFIG] --kl-budget NATS [--members K] [--section.field VALUE ...]`: train K runs of one config,
seeds apart, and merge them at the held-out KL budget (WARP, Ramé et al. 2024: `lmppo train` K times, then `lmppo
merge --kl-budget`).

Design notes: docs/design.md, `lmppo.apps.warp`."""

from __future__ import annotations

import gc
import json
import os
from typing import Any, Optional, Sequence

from lmppo.apps.arguments import warp_parser
from lmppo.apps.merge import check_budget_options, merge_to_budget
from lmppo.config import Config, load_config, parse_overrides, recipe_path
from lmppo.errors import ConfigError, LmppoError
from lmppo.run import lock
from lmppo.run.config_file import redacted_config_dict
from lmppo.run.layout import FINAL, POLICY
from lmppo.run.manifest import latest_checkpoint
from lmppo.run.storage import write_json
from lmppo.training.report import summarize_run
from lmppo.training.trainer import PPOTrainer

RECORD = "warp.json"


def member_dir(output_dir: str, index: int) -> str:
    return os.path.join(output_dir, f"member-{index}")


def merged_dir(output_dir: str, budget: float) -> str:
    return os.path.join(output_dir, f"merged-kl{budget:g}")


def member_overrides(cfg: Config, overrides: dict[str, str], index: int) -> dict[str, str]:
    """Member `index`'s overrides: its own folder and seed, the held-out split of the base config's seed."""
    return overrides | {
        "output_dir": member_dir(cfg.output_dir, index),
        "seed": str(cfg.seed + index),
        "data.holdout_seed": str(cfg.data.holdout_seed_for(cfg.seed)),
        "overwrite": "false",
    }


def check_record(cfg: Config, members: int) -> dict[str, Any]:
    """The warp.json this run writes; a folder holding another config's members is refused (one line naming the
    first field that differs)."""
    record = json.loads(json.dumps({"members": members, "config": redacted_config_dict(cfg)}))  # as read back
    path = os.path.join(cfg.output_dir, RECORD)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            old = json.load(fh)
        for key in ("members", "config"):
            if old.get(key) != record[key]:
                field = _first_difference(old.get(key), record[key]) if key == "config" else "members"
                raise ConfigError(
                    "output_dir",
                    cfg.output_dir,
                    f"holds the members of another lmppo warp ({field} differs from {path}); choose "
                    "another output_dir, or give the same config and --members to continue it",
                )
    else:
        refuse_foreign(cfg.output_dir)
    return record


def refuse_foreign(output_dir: str) -> None:
    """A folder with files but no warp.json is not lmppo warp's: nothing is written into it."""
    if (
        os.path.isdir(output_dir)
        and not os.path.isfile(os.path.join(output_dir, RECORD))
        and [f for f in os.listdir(output_dir) if f != lock.LOCK_NAME]
    ):
        raise ConfigError(
            "output_dir",
            output_dir,
            "already holds files and no warp.json; lmppo warp needs a new folder (or one of its own to continue)",
        )


def _first_difference(old: Any, new: Any, prefix: str = "") -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                return _first_difference(old.get(key), new.get(key), f"{prefix}{key}.")
    return prefix.rstrip(".") or "the config"


def train_member(config_path: Optional[str], overrides: dict[str, str], console: Any) -> str:
    """Train (or finish) one member; returns its folder. Finished: `final/policy` exists."""
    cfg = load_config(config_path, overrides)
    out = cfg.output_dir
    if os.path.isdir(os.path.join(out, FINAL, POLICY)):
        _say(console, f"{out}: finished, kept")
        return out
    checkpoint = latest_checkpoint(out)
    if checkpoint is not None:
        _say(console, f"{out}: resuming from {checkpoint}")
        trainer = PPOTrainer.resume(out, console=console)
    else:
        if os.path.isdir(out):  # stopped before its first checkpoint: nothing of it can be resumed
            cfg = load_config(config_path, overrides | {"overwrite": "true"})
        trainer = PPOTrainer(cfg, console=console)
    trainer.train()
    summarize_run(trainer, console)
    del trainer
    gc.collect()  # one member's models at a time (and its folder lock released)
    return out


def warp(
    config_path: Optional[str],
    overrides: dict[str, str],
    budget: float,
    members: int = 2,
    console: Any = None,
    **merge_options: Any,
) -> str:
    """Train the members (or finish them) and merge them at `budget`; returns the merged policy's folder."""
    if members < 2:
        raise LmppoError(
            f"lmppo warp: --members {members}: must be >= 2 (one run moved to a budget is `lmppo merge "
            "RUN -o OUT --kl-budget NATS`)"
        )
    check_budget_options(budget, **merge_options, command="lmppo warp")  # before the members train
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise LmppoError(
            "lmppo warp runs in one process; under a launcher, train the members with `lmppo train` "
            "(one data.holdout_seed, seeds apart) and merge them with `lmppo merge --kl-budget`"
        )
    cfg = load_config(config_path, overrides)
    cfg.validate()
    if cfg.push_to_hub:
        raise ConfigError(
            "push_to_hub",
            cfg.push_to_hub,
            "is not pushed by lmppo warp (it would push each member); "
            "push the merged folder with `lmppo push` afterwards",
        )
    for i in range(members):  # every member's config is checked before any training
        load_config(config_path, member_overrides(cfg, overrides, i)).validate()
    refuse_foreign(cfg.output_dir)  # before the lock file is made in it
    lock.acquire(cfg.output_dir)
    try:
        record = check_record(cfg, members)
        write_json(os.path.join(cfg.output_dir, RECORD), record, "the warp record", indent=1)
        runs = [train_member(config_path, member_overrides(cfg, overrides, i), console) for i in range(members)]
        out = merged_dir(cfg.output_dir, budget)
        if os.path.isdir(out):
            _say(console, f"{out}: already merged at this budget, kept")
            return out
        _say(console, f"merging {members} members at a held-out KL of {budget:g} nats:")
        _, chosen, _ = merge_to_budget(runs, out, budget, say=lambda line: _say(console, line), **merge_options)
        _say(
            console,
            f"wrote {out}: lambda {chosen.toward_start:.3f}, held-out KL {chosen.kl_exact:.2f} nats, "
            f"score {chosen.score:+.3f}",
        )
        if chosen.toward_start == 1.0 and chosen.kl_exact < (1 - merge_options.get("tolerance", 0.1)) * budget:
            _say(
                console,
                f"the whole merge is under the budget: members trained at a higher kl.target than "
                f"{cfg.kl.target:g} would give more reward at {budget:g} nats",
            )
        return out
    finally:
        lock.release(cfg.output_dir)


def _say(console: Any, line: str) -> None:
    if console is not None:
        console.print(line, highlight=False)
    else:
        print(line)


def main(argv: Sequence[str], console: Any = None) -> int:
    """`lmppo warp`; returns the exit code. Mistakes raise LmppoError (one line from the CLI)."""
    argv = list(argv)
    config = argv.pop(0) if argv and not argv[0].startswith("-") else recipe_path("sentiment")
    args, rest = warp_parser().parse_known_args(argv)
    overrides = parse_overrides(rest)
    warp(config, overrides, args.kl_budget, args.members, console, tolerance=args.tolerance, max_evals=args.max_evals)
    return 0
