"""`python -m lmppo ...`: the `lmppo` command."""

import sys

from lmppo.apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
