"""Library noise a user cannot act on, kept off the console: one function that the CLI, the Python API
(`lmppo.PPOTrainer`) and the TRL drop-in (`lmppo.trl.PPOTrainer`) all call.

It silences deprecation notices (FutureWarning, DeprecationWarning) of torch / transformers / accelerate / peft /
datasets / DeepSpeed, transformers' and DeepSpeed's info and warning logs ("Setting accelerator to CPU", ...), and
the progress bars of loading and writing models ("Loading weights", "Writing model shards") and of datasets
("Generating train split"). lmppo's own warnings (UserWarning) still show. `LMPPO_DEBUG=1` in the environment (set by
`lmppo --debug`) leaves everything as the libraries print it. Imports nothing of lmppo.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

LIBRARIES = ("torch", "transformers", "accelerate", "peft", "datasets", "deepspeed", "huggingface_hub", "lmppo")
"""Modules whose deprecation notices are silenced (lmppo: a library's notice attributed to its caller)."""
LOGGERS = ("DeepSpeed", "deepspeed", "accelerate", "torch.distributed", "gguf")
"""Loggers held to errors."""


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def quiet_libraries(all_warnings: bool = False) -> None:
    """Apply the settings above (idempotent). `all_warnings`: silence every FutureWarning and DeprecationWarning,
    whatever its module (the CLI, which owns its process); otherwise only those of `LIBRARIES`, so a program that
    uses lmppo as a library keeps its own. Does nothing when LMPPO_DEBUG is set to 1."""
    if os.environ.get("LMPPO_DEBUG") == "1":
        return
    module = "" if all_warnings else rf"({'|'.join(LIBRARIES)})(\.|$)"
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=module)
    # lmppo steps its schedule once per iteration, also when every update of it was skipped (a non-finite loss):
    # torch's warning about the order would print before lmppo's own line about the skipped updates
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before", category=UserWarning)
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.ERROR)
        if _errors_only not in logger.filters:  # DeepSpeed sets its logger's level again when imported: a filter stays
            logger.addFilter(_errors_only)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # read when datasets is imported
    if "datasets" in sys.modules:  # already imported (an optional package, imported only when it is there)
        from datasets.utils import disable_progress_bars

        disable_progress_bars()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
