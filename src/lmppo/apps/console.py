"""The console of the `lmppo` command: lines a user cannot act on stay off it."""

from __future__ import annotations

import logging
import os
import warnings

from transformers.utils import logging as hf_logging


def quiet_console(debug: bool) -> None:
    """Progress bars of model loading off (they would bury lmppo's one-line errors); without `--debug`, the
    libraries' notices too (`quiet_libraries`)."""
    if not debug:
        os.environ.setdefault("TQDM_DISABLE", "1")  # read by tqdm when it is imported (with transformers)
    hf_logging.disable_progress_bar()
    if not debug:
        quiet_libraries()


def quiet_libraries() -> None:
    """Lines a user cannot act on stay off the console: deprecation notices of torch / transformers / accelerate
    (FutureWarning, DeprecationWarning), transformers' and DeepSpeed's info and warning logs ("Setting accelerator
    to CPU", ...), and tqdm bars. lmppo's own warnings (UserWarning) still show; `--debug` shows everything."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    os.environ.setdefault("TQDM_DISABLE", "1")
    hf_logging.set_verbosity_error()
    for name in ("DeepSpeed", "deepspeed", "accelerate", "torch.distributed", "gguf"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.ERROR)
        # DeepSpeed sets its logger's level again when it is imported: a filter stays
        logger.addFilter(lambda record: record.levelno >= logging.ERROR)
