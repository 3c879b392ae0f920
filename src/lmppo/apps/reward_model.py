"""`lmppo reward-model [--data PAIRS] [--base MODEL] [--output-dir DIR] [...]`: train a reward model on preference
pairs (`lmppo.training.reward_model`); `--resume OUTPUT_DIR` continues a stopped one."""

from __future__ import annotations

from typing import Any, Sequence

from lmppo.apps.arguments import reward_model_parser
from lmppo.run import signals
from lmppo.training.reward_model import RewardModelSettings, train_reward_model


def main(argv: Sequence[str], console: Any = None) -> int:
    """`lmppo reward-model`; returns the exit code. Mistakes raise LmppoError (one line from the CLI)."""
    args = reward_model_parser().parse_args(list(argv))
    given = {k: v for k, v in vars(args).items() if v is not None and k != "resume"}
    settings = RewardModelSettings(**given)
    if args.resume is not None:
        settings = RewardModelSettings(output_dir=args.resume)
    say = console.print if console is not None else print
    try:
        result = train_reward_model(settings, resume=args.resume is not None, say=say)
    except KeyboardInterrupt as stop:
        out = settings.output_dir
        step = (
            f"continue with `lmppo reward-model --resume {out}`"
            if signals.has_checkpoint(out)
            else "it wrote no checkpoint yet: start it again with `--overwrite`"
        )
        print(f"{signals.how_stopped(stop)}; {step}")
        return signals.exit_code(stop)
    say(f"{result.steps} steps in {result.seconds:.0f} s")
    return 0
