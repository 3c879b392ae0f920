"""The `lmppo` command: `train`, `eval`, `plot`, `push`, `merge`, `warp`.

    lmppo train [CONFIG.yaml] [--section.field VALUE ...] [--resume OUTPUT_DIR] [--debug]

With no config, `train` runs the built-in default recipe. Every option of the config can be given on the
command line as a dotted override (`--ppo.num_epochs 2` or `--ppo.num_epochs=2`); `lmppo train --help` lists
them all with their documentation and default. Mistakes a user can make end with one line on stderr and
exit code 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import textwrap
import typing
from typing import Any, Literal, Optional, Sequence

from lmppo import __version__
from lmppo.apps.merge import main as merge_main
from lmppo.apps.push import check_hub_login, push_after_training
from lmppo.apps.push import main as push_main
from lmppo.apps.warp import main as warp_main
from lmppo.config.schema import Config, all_fields, load_config, parse_overrides, recipe_path  # noqa: F401  (re-exported)
from lmppo.config.yaml_input import load
from lmppo.errors import ConfigError, LmppoError
from lmppo.evaluation.evaluate import main as eval_main
from lmppo.evaluation.plot import plot_runs
from lmppo.evaluation.summary import print_run_summary
from lmppo.run import signals
from lmppo.training.trainer import PPOTrainer

EXIT_USER_ERROR = 2


def _type_name(tp: Any) -> str:
    """How --help shows a field's type: `{a,b,c}` for a choice, `LIST[...]` for a list, else the type's name."""
    if typing.get_origin(tp) is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(tp)) + "}"
    if typing.get_origin(tp) is list:
        return f"LIST[{_type_name(typing.get_args(tp)[0])}]"
    return (getattr(tp, "__name__", None) or str(tp).replace("typing.", "")).upper()


def train_help() -> str:
    lines = [
        "usage: lmppo train [CONFIG.yaml] [--section.field VALUE ...] [--resume OUTPUT_DIR] [--debug]",
        "",
        "Train a causal LM with PPO. With no CONFIG the built-in default recipe runs (lmppo/recipes/",
        "sentiment.yaml; the defaults below are those of an empty config). Any option below",
        "overrides the config file (lists: comma-separated or YAML `[a, b]`; mappings: YAML `{k: v}`).",
        "",
        "  --resume OUTPUT_DIR   continue the run in OUTPUT_DIR from its latest complete checkpoint",
        "  --debug               show tracebacks for errors",
        "",
        "options:",
    ]
    section = None
    for name, tp, default, doc in all_fields():
        head = name.split(".")[0] if "." in name else ""
        if head != section:
            section = head
            lines.append("")
            lines.append(f" [{head or 'run'}]")
        lines.append(f"  --{name} {_type_name(tp)}   (default: {default!r})")
        for chunk in textwrap.wrap(doc, 96):
            lines.append("      " + chunk)
    return "\n".join(lines)


def cmd_train(argv: Sequence[str], console) -> int:
    if "-h" in argv or "--help" in argv:
        print(train_help())
        return 0
    argv = list(argv)
    resume_dir: Optional[str] = None
    if "--resume" in argv:
        at = argv.index("--resume")
        if at + 1 >= len(argv):
            raise ConfigError("--resume", None, "needs the output_dir of the run to continue")
        resume_dir = argv[at + 1]
        del argv[at : at + 2]
    config_path = argv[0] if argv and not argv[0].startswith("--") else None
    overrides = parse_overrides(argv[1:] if config_path else argv)
    if config_path is None and resume_dir is None:
        config_path = recipe_path("sentiment")
    if resume_dir is not None:
        _refuse_ignored_with_resume(resume_dir, overrides, config_path)
        trainer = PPOTrainer.resume(resume_dir, overrides=overrides, config_path=config_path, console=console)
        if trainer.config.push_to_hub:
            check_hub_login(trainer.config.push_to_hub)  # before training, not after
    else:
        cfg = load_config(config_path, overrides)
        if cfg.push_to_hub:
            cfg.validate()
            check_hub_login(cfg.push_to_hub)  # before the models load, not after training
        trainer = PPOTrainer(cfg, console=console)
    trainer.train()
    print_run_summary(trainer, console)
    if trainer.config.push_to_hub and trainer.accelerator.is_main_process:
        push_after_training(trainer.config.output_dir, trainer.config.push_to_hub, console)
    if trainer.accelerator.num_processes > 1:
        # every process done, then the process group closed before the interpreter exits: left to exit-time
        # destructors, gloo's worker threads can abort a finished run ("terminate called without an active exception")
        trainer.accelerator.wait_for_everyone()
        trainer.accelerator.state.destroy_process_group()
    return 0


def _refuse_ignored_with_resume(resume_dir: str, overrides: dict, config_path: Optional[str]) -> None:
    """Options a resume would ignore are refused, not dropped: the run stays in its own folder and keeps its
    files."""
    for key, why in (
        ("output_dir", f"a resumed run stays in its own folder ({resume_dir})"),
        ("overwrite", "resuming continues the run and never removes its files"),
    ):
        if key in overrides:
            raise ConfigError(f"--{key}", overrides[key], f"cannot be given with --resume: {why}")
    if config_path:
        load_config(config_path)  # a broken file is refused here, with its own message
        given = _explicit_output_dir(config_path)
        if (
            given is not None
            and given != Config().output_dir
            and os.path.realpath(given) != os.path.realpath(resume_dir)
        ):
            raise ConfigError(
                "output_dir",
                given,
                f"in {config_path} is not the folder given to --resume "
                f"({resume_dir}); a resumed run stays in its own folder: give the run's own config "
                "or make them the same",
            )


def _explicit_output_dir(config_path: str) -> Optional[str]:
    with open(config_path, encoding="utf-8") as fh:
        data = load(fh)
    value = data.get("output_dir") if isinstance(data, dict) else None
    return str(value) if value is not None else None


def cmd_plot(argv: Sequence[str], console) -> int:
    parser = argparse.ArgumentParser(
        prog="lmppo plot",
        description="PNG of the key training curves from OUTPUT_DIR/metrics.jsonl; several runs are overlaid.",
    )
    parser.add_argument("run_dirs", nargs="+", help="output_dir of one or more runs")
    parser.add_argument("-o", "--output", default=None, help="PNG path (default: FIRST_RUN/curves.png)")
    args = parser.parse_args(argv)
    out = args.output or os.path.join(args.run_dirs[0], "curves.png")
    console.print(f"wrote {plot_runs(args.run_dirs, out)}")
    return 0


def cmd_eval(argv: Sequence[str], console) -> int:
    return eval_main(argv, console)


def cmd_push(argv: Sequence[str], console) -> int:
    return push_main(argv, console)


def cmd_merge(argv: Sequence[str], console) -> int:
    return merge_main(argv, console)


def cmd_warp(argv: Sequence[str], console) -> int:
    return warp_main(argv, console)


def quiet_libraries() -> None:
    """Lines a user cannot act on stay off the console: deprecation notices of torch / transformers / accelerate
    (FutureWarning, DeprecationWarning), transformers' and DeepSpeed's info and warning logs ("Setting accelerator
    to CPU", ...), and tqdm bars. lmppo's own warnings (UserWarning) still show; `--debug` shows everything."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    os.environ.setdefault("TQDM_DISABLE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    for name in ("DeepSpeed", "deepspeed", "accelerate", "torch.distributed", "gguf"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.ERROR)
        # DeepSpeed sets its logger's level again when it is imported: a filter stays
        logger.addFilter(lambda record: record.levelno >= logging.ERROR)


def _output_dir_of(argv: Sequence[str]) -> Optional[str]:
    """The run folder a `train` command line writes to, for messages (best effort, never raises)."""
    argv = list(argv)
    try:
        if "--resume" in argv and argv.index("--resume") + 1 < len(argv):
            return argv[argv.index("--resume") + 1]
        for i, arg in enumerate(argv):
            if arg.startswith("--output_dir="):
                return arg.split("=", 1)[1]
            if arg == "--output_dir" and i + 1 < len(argv):
                return argv[i + 1]
        if argv and not argv[0].startswith("--"):
            return load_config(argv[0]).output_dir
    except Exception:  # noqa: BLE001 - only for a message
        return None
    return None


COMMANDS = {
    "train": cmd_train,
    "eval": cmd_eval,
    "plot": cmd_plot,
    "push": cmd_push,
    "merge": cmd_merge,
    "warp": cmd_warp,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from rich.console import Console

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    console = Console(highlight=False)
    if not debug:
        os.environ.setdefault("TQDM_DISABLE", "1")  # read by tqdm when it is imported (with transformers)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # loading bars on stderr would bury lmppo's one-line errors
    if not debug:
        quiet_libraries()
    if argv and argv[0] in ("-V", "--version"):
        print(f"lmppo {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: lmppo {train,eval,plot,push,merge,warp} ...   (lmppo train --help lists every training option; "
            "lmppo --version)"
        )
        return 0 if argv else EXIT_USER_ERROR
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        hint = difflib.get_close_matches(command, list(COMMANDS), n=1)
        print(
            f"error: unknown command {command!r}"
            + (f" (did you mean `{hint[0]}`?)" if hint else "")
            + "; commands: train, eval, plot, push, merge, warp",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    if command in ("train", "warp"):
        signals.terminate_like_interrupt()  # SIGTERM (schedulers): cleaned up and explained like Ctrl-C, exit 143
    try:
        return COMMANDS[command](rest, console)
    except LmppoError as err:
        if debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (`lmppo.run.signals.Terminated`)
        if command == "warp":
            print(
                f"{signals.how_stopped(stop)}; run the same `lmppo warp` command again: finished members are kept, "
                "the interrupted one resumes from its latest complete checkpoint",
                file=sys.stderr,
            )
            return signals.exit_code(stop)
        out = _output_dir_of(rest) if command == "train" else None
        print(f"{signals.how_stopped(stop)}; {signals.next_step(out, rest)}", file=sys.stderr)
        return signals.exit_code(stop)


if __name__ == "__main__":
    sys.exit(main())
