"""`python -m lmppo.cli ...`: the `lmppo` command under its old module name, kept so that scripts and launchers
written for it (`torchrun -m lmppo.cli train ...`) keep working. `python -m lmppo` is the name that never moves;
the command itself is `lmppo.apps.cli`."""

import sys

from lmppo.apps.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
