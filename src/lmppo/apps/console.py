"""The console of the `lmppo` command: lines a user cannot act on stay off it."""

from __future__ import annotations

import os
import warnings

from transformers.utils import logging as hf_logging

from lmppo.quiet import quiet_libraries


def quiet_console(debug: bool) -> None:
    """Progress bars of model loading off (they would bury lmppo's one-line errors); without `--debug`, the
    libraries' notices too, every FutureWarning and DeprecationWarning included (`lmppo.quiet`, which the Python API
    and the TRL drop-in call too); `--debug` shows everything."""
    if debug:
        os.environ["LMPPO_DEBUG"] = "1"  # read by quiet_libraries, here and in the trainer
    else:
        os.environ.setdefault("TQDM_DISABLE", "1")  # read by tqdm when it is imported (with transformers)
    hf_logging.disable_progress_bar()
    quiet_libraries(all_warnings=True)
    if not debug:
        warnings.formatwarning = one_line_warning


def one_line_warning(message, category, filename, lineno, line=None) -> str:  # noqa: ANN001 - warnings' signature
    """A warning on the console as one line, like lmppo's `error:` lines (Python's default adds the file, the
    line number and the source line that raised it, which a user cannot act on); `--debug` keeps the default."""
    return f"warning: {message}\n"
