"""The command lines of `lmppo plot`, `merge`, `push`, `warp` and `reward-model` (`eval`'s:
`lmppo.evaluation.arguments`), apart from the commands: only argparse and the config schema here, so `--help` and
argument errors answer without importing torch or transformers (`lmppo.apps.cli.check_arguments` parses them
first). `reward-model` reads a YAML file and dotted overrides, as `lmppo train` does."""

import argparse
from dataclasses import dataclass
from typing import Optional, Sequence

from lmppo.config import RewardModelConfig, load_root, parse_overrides
from lmppo.errors import ConfigError
from lmppo.evaluation.arguments import eval_parser
from lmppo.run.layout import POLICY, POLICY_MERGED, VALUE

__all__ = [
    "eval_parser",
    "merge_parser",
    "plot_parser",
    "push_parser",
    "warp_parser",
    "reward_model_arguments",
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


RENAMED = {
    "--data": "--data.pairs",
    "--base": "--model.policy",
    "--output-dir": "--output_dir",
    "--full": "--model.lora.enabled false",
    "--lora-r": "--model.lora.r",
    "--epochs": "--training.epochs",
    "--learning-rate": "--training.learning_rate",
    "--batch-size": "--training.batch_size",
    "--held-out": "--data.holdout",
    "--max-length": "--data.max_length",
    "--checkpoint-every": "--checkpoint.every",
}
"""`lmppo reward-model`'s options before it took `lmppo train`'s spelling, and what they are now."""


class RenamedOption(ConfigError):
    """An option of `lmppo reward-model`'s old spelling: one line naming the new one."""

    def __init__(self, option: str, now: str):
        self.field, self.value, self.allowed = option, None, f"is now `{now}`"
        Exception.__init__(
            self, f"option `{option}` is now `{now}` (as `lmppo train` spells it); see `lmppo reward-model --help`"
        )


@dataclass
class RewardModelArguments:
    """A `lmppo reward-model` command line: a YAML file and dotted overrides, or `--resume OUTPUT_DIR`."""

    config_path: Optional[str]
    overrides: dict[str, str]
    resume: Optional[str]

    def config(self) -> RewardModelConfig:
        """The run's config (pydantic, no torch: a mistake is one line before any model loads)."""
        return load_root(RewardModelConfig, self.config_path, self.overrides)


def reward_model_arguments(argv: Sequence[str]) -> RewardModelArguments:
    """`lmppo reward-model [CONFIG.yaml] [--section.field VALUE ...] | --resume OUTPUT_DIR`, read as `lmppo train`
    reads its own; an option of the command's old spelling is one ConfigError naming the new one."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        name = arg.split("=", 1)[0]
        if name in RENAMED:
            raise RenamedOption(name, RENAMED[name])
        if arg == "--overwrite" and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
            raise RenamedOption("--overwrite", "--overwrite true")
    resume = None
    if "--resume" in argv:
        at = argv.index("--resume")
        if at + 1 >= len(argv):
            raise ConfigError("--resume", None, "needs the output_dir of the run to continue")
        resume = argv[at + 1]
        del argv[at : at + 2]
        if argv:
            raise ConfigError(
                "--resume", resume, f"takes no other option ({argv[0]}): a resumed run keeps its own config.yaml"
            )
    config_path = argv[0] if argv and not argv[0].startswith("--") else None
    rest = argv[1:] if config_path else argv
    return RewardModelArguments(config_path, parse_overrides(rest, RewardModelConfig, "lmppo reward-model"), resume)
