"""`lmppo reward-model [CONFIG.yaml] [--section.field VALUE ...]`: train a reward model on preference pairs
(`lmppo.training.reward_model`), its options spelled as `lmppo train`'s; `--resume OUTPUT_DIR` continues a stopped
one."""

from __future__ import annotations

import os
from typing import Any, Sequence

from lmppo.apps.arguments import reward_model_arguments
from lmppo.config import load_config
from lmppo.training.reward_model import RewardModelTrainer


def main(argv: Sequence[str], console: Any = None) -> int:
    """`lmppo reward-model`; returns the exit code. Mistakes raise LmppoError (one line from the CLI)."""
    args = reward_model_arguments(argv)
    say = console.print if console is not None else print
    # a stop signal ends in the CLI with one line on stderr (`lmppo.apps.cli.AFTER_STOP`): resume it with --resume
    if args.resume is not None:
        trainer = RewardModelTrainer.resume(args.resume, say=say)
    else:
        trainer = RewardModelTrainer(args.config(), say=say)
    result = trainer.train()
    if trainer.main:
        say(f"{result.steps} steps in {result.seconds:.0f} s")
        if recipe_reads(RECIPE_ON_IT, result.model_dir):
            say(f"PPO on it, from this folder: lmppo train builtin:{RECIPE_ON_IT}")
    return 0


RECIPE_ON_IT = "learned_reward"
"""The packaged recipe whose reward model is the folder `lmppo reward-model` writes by default."""


def recipe_reads(recipe: str, model_dir: str) -> bool:
    """Whether packaged recipe `recipe`, run from the current folder, takes `model_dir` as a reward model."""
    sources = load_config(f"builtin:{recipe}").reward.sources
    return any(s.kind == "model" and os.path.abspath(s.path) == os.path.abspath(model_dir) for s in sources)
