"""Start-up of the `lmppo` command: wall time of `python -m lmppo --version`, `--help` and `train --help` as whole
processes, from two source trees, runs alternating; min and median per tree and command (docs/performance.md,
"Start-up").

    python benchmarks/speed/startup_time.py BEFORE_TREE AFTER_TREE [N]   # e.g. a `git worktree` of the old commit
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

COMMANDS = (["--version"], ["--help"], ["train", "--help"])


def main() -> None:
    trees = {"before": sys.argv[1], "after": sys.argv[2]}
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 7
    times: dict[tuple[str, str], list[float]] = {(t, " ".join(c)): [] for t in trees for c in COMMANDS}
    for i in range(n):
        for command in COMMANDS:
            order = list(trees.items()) if i % 2 == 0 else list(reversed(trees.items()))  # alternate who goes first
            for tree, root in order:
                env = dict(os.environ, PYTHONPATH=os.path.join(root, "src"))
                start = time.perf_counter()
                subprocess.run([sys.executable, "-m", "lmppo", *command], env=env, capture_output=True, check=True)
                times[(tree, " ".join(command))].append(time.perf_counter() - start)
    for (tree, command), values in times.items():
        print(f"{tree:6} lmppo {command:13} n={n}  min {min(values):.2f} s  median {statistics.median(values):.2f} s")
    print("load average:", " ".join(f"{x:.1f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
