"""The `lmppo` command: `train`, `eval`, `plot`, `push`, `merge`, `warp`, `reward-model`.

    lmppo train [CONFIG.yaml | builtin:RECIPE] [--section.field VALUE ...] [--resume OUTPUT_DIR] [--debug]

With no config, `train` runs the built-in default recipe. Every option of the config can be given on the
command line as a dotted override (`--ppo.num_epochs 2` or `--ppo.num_epochs=2`); `lmppo train --help` lists
them all with their documentation and default. Mistakes a user can make end with one line on stderr and
exit code 2; `--debug` shows the traceback instead.

Start-up: this module imports no torch, transformers or rich. Each command's module is imported only when that
command runs, so `lmppo --version`, `lmppo --help` and `lmppo train --help` answer at once (docs/performance.md).
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from typing import Any, Optional, Sequence

from lmppo import __version__
from lmppo.errors import LmppoError
from lmppo.run import signals

EXIT_USER_ERROR = 2

COMMANDS = {
    # name: (the function that runs it, imported when the command runs; what it does, for `lmppo --help`)
    "train": ("lmppo.apps.train:cmd_train", "train a causal LM with PPO from a config (`lmppo train --help`)"),
    "eval": ("lmppo.apps.cli:cmd_eval", "score a policy (a run's final model or a folder) on prompts"),
    "plot": ("lmppo.apps.cli:cmd_plot", "PNG of the training curves of one or more runs"),
    "push": ("lmppo.apps.cli:cmd_push", "upload a finished run's model to the Hugging Face Hub"),
    "merge": ("lmppo.apps.cli:cmd_merge", "average the policies of several runs into one model"),
    "warp": ("lmppo.apps.cli:cmd_warp", "train several runs and merge them (WARP), within a KL budget"),
    "reward-model": ("lmppo.apps.reward_model:main", "train a reward model on preference pairs (Bradley-Terry)"),
}


PARSERS = {name: f"{name}_parser" for name in ("eval", "plot", "push", "merge", "warp")}
"""The commands whose arguments are parsed before their imports (`lmppo.apps.arguments`): --help, a mistake."""
TAKE_OVERRIDES = ("eval", "warp")
"""Commands whose other options are config overrides (`--section.field VALUE`)."""


def check_arguments(command: str, argv: Sequence[str]) -> Optional[int]:
    """Parse a command's arguments before torch and transformers load: `--help` prints its help (exit code 0), a
    mistake one usage line and one `error:` line (2); None when they parse and the command should run."""
    from lmppo.apps import arguments

    if command == "reward-model":  # a YAML file and dotted overrides, as `lmppo train`: the config built here
        try:
            arguments.reward_model_arguments(argv).config()
        except LmppoError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_USER_ERROR
        return None
    parser = getattr(arguments, PARSERS[command])()
    argv = list(argv)
    try:
        if command not in TAKE_OVERRIDES:
            parser.parse_args(argv)
            return None
        if command == "warp" and argv and not argv[0].startswith("-"):
            argv = argv[1:]  # the config file
        _, rest = parser.parse_known_args(argv)
        from lmppo.config import parse_overrides

        parse_overrides(rest)
    except SystemExit as done:  # argparse: --help (0) or a usage error (2), already printed
        return int(done.code or 0)
    except LmppoError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    return None


def main_help() -> str:
    lines = ["usage: lmppo COMMAND [ARGS ...] [--debug]   (lmppo --version; lmppo COMMAND --help)", "", "commands:"]
    lines += [f"  {name:<12} {what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", "  --debug  show tracebacks for errors", "  --version, -V  print the version"]
    return "\n".join(lines)


# The commands other than `train` import their modules here, when they run (start-up: see the module docstring).
def cmd_plot(argv: Sequence[str], console: Any) -> int:
    from lmppo.apps.arguments import plot_parser
    from lmppo.evaluation.plot import plot_runs

    args = plot_parser().parse_args(argv)
    out = args.output or os.path.join(args.run_dirs[0], "curves.png")
    console.print(f"wrote {plot_runs(args.run_dirs, out)}")
    return 0


def cmd_eval(argv: Sequence[str], console: Any) -> int:
    from lmppo.evaluation.evaluate import main as eval_main

    return eval_main(argv, console)


def cmd_push(argv: Sequence[str], console: Any) -> int:
    from lmppo.apps.push import main as push_main

    return push_main(argv, console)


def cmd_merge(argv: Sequence[str], console: Any) -> int:
    from lmppo.apps.merge import main as merge_main

    return merge_main(argv, console)


def cmd_warp(argv: Sequence[str], console: Any) -> int:
    from lmppo.apps.warp import main as warp_main

    return warp_main(argv, console)


AFTER_STOP = {
    "warp": "run the same `lmppo warp` command again: finished members are kept, the interrupted one resumes from its "
    "latest complete checkpoint",
    "eval": "the evaluation did not finish and wrote nothing; run the same `lmppo eval` command again",
    "merge": "the merged model was not written (its temporary is removed); run the same `lmppo merge` command again",
    "push": "the upload did not finish (the Hub keeps only whole commits); run the same `lmppo push` command again",
    "plot": "no plot was written; run the same `lmppo plot` command again",
    "reward-model": "continue it with `lmppo reward-model --resume OUTPUT_DIR` once it has a checkpoint (else run the "
    "same command again with `--overwrite true`)",
}
"""What to do after a stop signal, per command (`train`: `lmppo.run.signals.next_step`, which looks at the run)."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The `lmppo` command; `argv` given: called in-process (tests), where the signal handlers are put back after."""
    in_process = argv is not None
    before = signals.handlers()
    signals.install()  # first: a signal during the slow imports below ends with one line and 128 + N too
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args else ""
    run: list[Optional[str]] = []  # the run folder of `lmppo train`, read before the slow imports, for the advice
    try:
        if command == "train":
            run.append(output_dir_of([a for a in args[1:] if a != "--debug"]))
        code = _run(args)
    except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM, SIGHUP (`lmppo.run.signals`), at any moment of the command
        if "--debug" in args:
            raise
        # no import from here on: a signal during one leaves its module half-imported
        print(f"{signals.how_stopped(stop)}; {_after_stop(command, args[1:], run)}", file=sys.stderr)
        code = signals.exit_code(stop)
    finally:
        if in_process:
            signals.restore(before)
    if not in_process:
        signals.ended(code)
    return code


def _after_stop(command: str, rest: Sequence[str], run: Sequence[Optional[str]]) -> str:
    if command in AFTER_STOP:
        return AFTER_STOP[command]
    if command == "train":
        return signals.next_step(run[0] if run else None, [a for a in rest if a != "--debug"])
    return f"nothing of it is complete; run the same `lmppo {command}` command again" if command else "stopped"


def output_dir_of(argv: Sequence[str]) -> Optional[str]:
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
        if any(a in ("-h", "--help") for a in argv):
            return None
        from lmppo.config import load_config, recipe_path  # pydantic, not torch: read before the slow imports

        return load_config(argv[0] if argv and not argv[0].startswith("--") else recipe_path("sentiment")).output_dir
    except Exception:  # noqa: BLE001 - only for a message
        return None


def _run(argv: list[str]) -> int:
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if argv and argv[0] in ("-V", "--version"):
        print(f"lmppo {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(main_help())
        return 0 if argv else EXIT_USER_ERROR
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        hint = difflib.get_close_matches(command, list(COMMANDS), n=1)
        print(
            f"error: unknown command {command!r}"
            + (f" (did you mean `{hint[0]}`?)" if hint else "")
            + "; commands: "
            + ", ".join(COMMANDS),
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    if command in ("train", "reward-model") and ("-h" in rest or "--help" in rest):
        from lmppo.config.help import reward_model_help, train_help  # here: `lmppo --version` needs no pydantic

        print(train_help() if command == "train" else reward_model_help())
        return 0
    if command in PARSERS or command == "reward-model":
        code = check_arguments(command, rest)
        if code is not None:
            return code
    if not debug:
        os.environ.setdefault("TQDM_DISABLE", "1")  # read by tqdm when it is imported (with transformers)
    try:
        # the heavy imports (torch, transformers, rich) happen from here on, for the command that runs
        from lmppo.apps.console import quiet_console
        from lmppo.evaluation.tables import make_console

        quiet_console(debug)
        console = make_console()
        module, _, function = COMMANDS[command][0].partition(":")
        return getattr(importlib.import_module(module), function)(rest, console)
    except LmppoError as err:
        if debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
