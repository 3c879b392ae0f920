"""`lmppo train`: a run from a config file and dotted overrides, or `--resume OUTPUT_DIR`; the model is pushed to the
Hub at the end when `push_to_hub` is set."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from lmppo.apps.push import check_hub_login, push_after_training
from lmppo.config import Config, config_file, load_config, parse_overrides, recipe_path
from lmppo.config.yaml_input import load
from lmppo.errors import ConfigError
from lmppo.training.inputs import ACCEPT_FLAG
from lmppo.training.report import summarize_run
from lmppo.training.trainer import PPOTrainer


def cmd_train(argv: Sequence[str], console: Any) -> int:
    """`lmppo train ...` (the help is `lmppo.config.help.train_help`, printed by the CLI without this import)."""
    argv = list(argv)
    accept_changed = ACCEPT_FLAG in argv
    argv = [a for a in argv if a != ACCEPT_FLAG]
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
        trainer = PPOTrainer.resume(
            resume_dir,
            overrides=overrides,
            config_path=config_path,
            console=console,
            accept_changed_inputs=accept_changed,
        )
        if trainer.config.push_to_hub:
            check_hub_login(trainer.config.push_to_hub)  # before training, not after
    else:
        if accept_changed:
            raise ConfigError(ACCEPT_FLAG, True, "goes with --resume (a new run records its inputs as they are)")
        cfg = load_config(config_path, overrides)
        if cfg.push_to_hub:
            cfg.validate()
            check_hub_login(cfg.push_to_hub)  # before the models load, not after training
        trainer = PPOTrainer(cfg, console=console)
    trainer.train()
    summarize_run(trainer, console)
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
    with open(config_file(config_path), encoding="utf-8") as fh:
        data = load(fh)
    value = data.get("output_dir") if isinstance(data, dict) else None
    return str(value) if value is not None else None
