"""`precision: auto` decided N times, each in a fresh process, while other jobs load every core: the same decision
every time (it is read from the CPU's capabilities, not timed).

    PYTHONPATH=src python benchmarks/tools/precision_decision.py [--runs 20] [--load-jobs 2] [--python PY]

The load: `--load-jobs` processes multiplying 512x512 matrices in fp32 and bf16 (the work a timing probe compares)
for as long as the decisions run. Printed: one line per decision (precision, reason, the 1-minute load average at
that moment), then how many distinct decisions there were; exit 1 when more than one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DECIDE = r"""
import json
from lmppo.models.precision import choose_precision
choice = choose_precision("auto", "cpu")
print(json.dumps({"precision": choice.precision, "reason": choice.reason}))
"""

LOAD = r"""
import torch
torch.set_num_threads(1)
a32 = torch.randn(512, 512); a16 = a32.bfloat16()
while True:
    a32 @ a32
    a16 @ a16
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--load-jobs", type=int, default=2)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, ["src", os.environ.get("PYTHONPATH")]))}
    load = [subprocess.Popen([args.python, "-c", LOAD], env=env) for _ in range(args.load_jobs)]
    try:
        time.sleep(3)  # the load is running before the first decision
        decisions = []
        for i in range(args.runs):
            out = subprocess.run([args.python, "-c", DECIDE], env=env, capture_output=True, text=True, check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            decisions.append((got["precision"], got["reason"]))
            print(f"{i + 1:2d}: {got['precision']} ({got['reason']}); load average {os.getloadavg()[0]:.2f}")
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
    distinct = sorted(set(decisions))
    print(f"{len(decisions)} decisions beside {args.load_jobs} loading job(s): {len(distinct)} distinct: {distinct}")
    return 0 if len(distinct) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
