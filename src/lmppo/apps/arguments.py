"""The command lines of `lmppo plot`, `merge`, `push`, `warp` and `reward-model` (`eval`'s:
`lmppo.evaluation.arguments`), apart from the commands: only argparse here, so `--help` and argument errors answer
without importing torch or transformers (`lmppo.apps.cli.check_arguments` parses them first)."""

import argparse

from lmppo.evaluation.arguments import eval_parser
from lmppo.run.layout import POLICY, POLICY_MERGED, VALUE

__all__ = [
    "eval_parser",
    "merge_parser",
    "plot_parser",
    "push_parser",
    "warp_parser",
    "reward_model_parser",
    "PUSH_FOLDERS",
]

MERGE_WHAT = (
    "`lmppo merge RUN RUN [...] --output DIR [--toward-start LAMBDA | --kl-budget NATS]`: average the policies of "
    "runs that started from the same model (WARP's merging step, Ramé et al. 2024), optionally moved back toward "
    "that start."
)
PUSH_FOLDERS = (POLICY_MERGED, POLICY, VALUE)
"""The folders of RUN/final that `lmppo push --folder` may upload."""


def plot_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmppo plot",
        description="PNG of the key training curves from OUTPUT_DIR/metrics.jsonl; several runs are overlaid.",
    )
    p.add_argument("run_dirs", nargs="+", help="output_dir of one or more runs")
    p.add_argument("-o", "--output", default=None, help="PNG path (default: FIRST_RUN/curves.png)")
    return p


def merge_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmppo merge", description=MERGE_WHAT)
    p.add_argument("inputs", nargs="+", help="runs (their final/policy) or model folders, all from one start model")
    p.add_argument("--output", "-o", required=True, help="a new folder for the merged policy")
    p.add_argument(
        "--toward-start",
        type=float,
        default=None,
        metavar="LAMBDA",
        help="scale the averaged weight change by LAMBDA (default 1; 0 gives the start model back)",
    )
    p.add_argument(
        "--kl-budget",
        type=float,
        default=None,
        metavar="NATS",
        help="choose LAMBDA so that the merged policy's held-out KL to the start (per response, as lmppo "
        "eval measures it) is NATS; measured on the runs' held-out prompts",
    )
    p.add_argument(
        "--start",
        default=None,
        help="full-weight models only: the model the runs started from "
        "(needed with --toward-start; with --kl-budget, default the runs' model.policy)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="with --kl-budget: the runs' config (prompts, held-out split, "
        "sampling, rewards); default the first run's config.yaml",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.1,
        help="with --kl-budget: accept a KL within this fraction of the budget (default 0.1)",
    )
    p.add_argument(
        "--max-evals", type=int, default=5, help="with --kl-budget: at most this many LAMBDAs measured (default 5)"
    )
    p.add_argument(
        "--samples-per-prompt",
        type=int,
        default=4,
        help="with --kl-budget: responses per held-out prompt for each measurement (default 4)",
    )
    p.add_argument("--seed", type=int, default=None, help="with --kl-budget: sampling seed (default the run's)")
    return p


def push_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmppo push",
        description="Upload a run's final model (with its model card) to the Hugging Face Hub. "
        "Log in first (`hf auth login`, or HF_TOKEN); HF_ENDPOINT selects another Hub.",
    )
    p.add_argument("run", help="a run's output_dir (its final/ model is uploaded) or a model folder")
    p.add_argument("--repo-id", required=True, help="the Hub model repo, ORG/NAME (created if missing)")
    p.add_argument(
        "--folder",
        choices=PUSH_FOLDERS,
        default=None,
        help="which folder of RUN/final to upload (default: "
        "policy-merged when the run has it, a LoRA run's full weights; else policy)",
    )
    p.add_argument("--private", action="store_true", default=None, help="create the repo private")
    p.add_argument("--revision", default=None, help="branch to commit to (default: main)")
    p.add_argument("--commit-message", default=None, help="the commit's message")
    return p


def warp_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmppo warp",
        allow_abbrev=False,
        description="Train K runs of one config, seeds apart on one held-out split, and merge "
        "them at a held-out KL budget (WARP: `lmppo train` K times, then `lmppo merge "
        "--kl-budget`). Run it again to continue a killed run or to merge at another budget.",
        usage="lmppo warp [CONFIG] --kl-budget NATS [--members K] [--section.field VALUE ...]",
        epilog="Any other option is a config override, as for `lmppo train` (--kl.target 20).",
    )
    p.add_argument(
        "--kl-budget",
        type=float,
        required=True,
        metavar="NATS",
        help="the merged policy's held-out KL to the start, per response (as lmppo eval measures it)",
    )
    p.add_argument("--members", type=int, default=2, help="runs to train and merge (default 2)")
    p.add_argument("--tolerance", type=float, default=0.1, help="accept a KL within this fraction of the budget")
    p.add_argument("--max-evals", type=int, default=5, help="at most this many lambdas measured")
    return p


def reward_model_parser() -> argparse.ArgumentParser:
    """Every option defaults to None: the command fills in RewardModelSettings' own defaults (which live with the
    trainer, beside torch)."""
    p = argparse.ArgumentParser(
        prog="lmppo reward-model",
        description="Train a reward model on preference pairs (TRL's format: `chosen`, `rejected`, optional "
        "`prompt`; text or chat) with the Bradley-Terry loss; held-out pair accuracy and margin before, after each "
        "epoch and at the end. With no option: the built-in pairs of positive over negative movie-review sentences, "
        "whole and as continuations of the default recipe's prompts, on SmolLM2-135M with LoRA (docs/stages.md). "
        "The result, OUTPUT_DIR/model, is what "
        "`reward.sources: [{kind: model, path: OUTPUT_DIR/model}]` takes.",
    )
    p.add_argument(
        "--data",
        help="a .jsonl file, a datasets folder, a .parquet / .arrow file, builtin:polarity-mixed (default), "
        "builtin:polarity or builtin:polarity-continuations",
    )
    p.add_argument("--base", help="model to start from: a folder, a Hub id or a built-in name (default smollm2)")
    p.add_argument("--output-dir", help="the run folder (default runs/reward-model)")
    p.add_argument("--full", dest="lora", action="store_false", default=None, help="train every weight, not LoRA")
    p.add_argument("--lora-r", type=int, help="LoRA rank (default 16)")
    p.add_argument("--epochs", type=int, help="passes over the training pairs (default 2)")
    p.add_argument("--learning-rate", type=float, help="AdamW learning rate (default 2e-4)")
    p.add_argument("--batch-size", type=int, help="pairs per optimizer step (default 8)")
    p.add_argument("--held-out", type=int, help="pairs kept out for accuracy and margin (default 30)")
    p.add_argument("--max-length", type=int, help="tokens per text at most, cut from the start (default 128)")
    p.add_argument("--seed", type=int, help="seed of the split, the data order and the new head (default 0)")
    p.add_argument("--checkpoint-every", type=int, help="optimizer steps between checkpoints (default 5)")
    p.add_argument("--overwrite", action="store_true", default=None, help="replace an earlier reward-model run there")
    p.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16"),
        help="auto (default): bf16 autocast where the CPU has native bf16, as lmppo train; or fp32, bf16",
    )
    p.add_argument("--resume", metavar="OUTPUT_DIR", help="continue that run from its latest complete checkpoint")
    return p
