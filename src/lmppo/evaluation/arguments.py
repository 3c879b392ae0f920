"""The command line of `lmppo eval`, apart from the command (only argparse here: `lmppo eval --help` and argument
errors answer without importing torch or transformers)."""

import argparse


def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmppo eval",
        description="Score a trained policy against its starting point on held-out prompts: mean reward per "
        "source, win rate by a judge, KL to the start (k1, k3, exact), response length. Any other "
        "--section.field VALUE overrides the run's config (e.g. --rollout.temperature 1.0).",
    )
    p.add_argument("model", help="a run's output_dir, OUTPUT_DIR/final/policy, a model folder or a LoRA adapter folder")
    p.add_argument(
        "--reference",
        default=None,
        help="the starting model to compare with (default: the adapter's "
        "base with the adapter off, else the run's model.policy)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="config YAML giving prompts, rewards and sampling (default: the "
        "run's config.yaml, else the built-in default recipe)",
    )
    p.add_argument(
        "--judge",
        default=None,
        help="reward source (by name) that decides the win rate (default: the "
        "first source of weight 0, else the first source)",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=0,
        help="evaluate on at most this many prompts (default: all "
        "held-out prompts; 64 training prompts when the run kept none out)",
    )
    p.add_argument(
        "--samples-per-prompt", type=int, default=4, help="responses sampled per prompt, by each model (default 4)"
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the run's seed)")
    p.add_argument("--show", type=int, default=3, help="example responses to print (default 3)")
    p.add_argument(
        "--output",
        "-o",
        default=None,
        help="JSON file for the results (default: RUN/eval.json, or eval.json next to the model folder)",
    )
    return p
